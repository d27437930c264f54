"""How the model calls attention: the engine's attention choice, decided once
(`AttentionSpec.for_engine`), and the call of `pallas_kernels`' ragged paged
attention on one layer of the cache with a step's metadata."""

from __future__ import annotations

import dataclasses
import math

from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.model.kv_cache import KVCache


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """backend: "auto" | "reference" | "pallas" (see `pallas_kernels`).
    sliding_window: keys a query sees (None: all before it). num_sink_tokens:
    first tokens every query sees beside its window (streaming eviction).
    The engine frees pages behind the window with the same two numbers."""

    backend: str = "auto"
    sliding_window: int | None = None
    num_sink_tokens: int = 0

    @classmethod
    def for_engine(cls, model: ModelConfig, engine: EngineConfig) -> "AttentionSpec":
        """The one place the window is decided: the model's own (Mistral's
        `sliding_window`), or streaming eviction's recent window beside a
        few sink tokens."""
        if engine.kv_eviction == "streaming":
            return cls(engine.attention_backend, engine.streaming_window, engine.num_sink_tokens)
        return cls(engine.attention_backend, model.sliding_window, 0)


def paged_attention(q, cache: KVCache, layer: int, batch, spec: AttentionSpec, *,
                    all_decode: bool | None = None, soft_cap: float | None = None):
    """q [T, H, D] against layer `layer` of the paged cache -> [T, H, D].
    `batch` carries kv_lens [S], block_tables [S, W], cu_q_lens [S + 1] and
    num_seqs []; `all_decode` is the kernel's static hint (see there)."""
    from pallas_kernels import ragged_paged_attention

    kw = {"num_sink_tokens": spec.num_sink_tokens} if spec.num_sink_tokens else {}
    if cache.quantized:
        kw.update(k_scale=cache.k_scale[layer], v_scale=cache.v_scale[layer])
    return ragged_paged_attention(
        q, cache.k[layer], cache.v[layer], batch.kv_lens, batch.block_tables,
        batch.cu_q_lens, batch.num_seqs, sm_scale=1.0 / math.sqrt(q.shape[-1]),
        sliding_window=spec.sliding_window, soft_cap=soft_cap, backend=spec.backend,
        all_decode=all_decode, **kw)
