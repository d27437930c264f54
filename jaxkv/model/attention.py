"""How the model calls attention: the engine's attention choice, decided once
(`AttentionSpec.for_engine`), and one layer's cache write and call of
`pallas_kernels`' ragged paged attention with a step's metadata; under a
mesh both run per shard (`shard_map` over "model") on that shard's heads,
so the cache is never gathered."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.model.kv_cache import KVCache, layer_arrays, replace_layer, write_pages


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """backend: "auto" | "reference" | "pallas" (see `pallas_kernels`).
    sliding_window: keys a query sees (None: all before it). num_sink_tokens:
    first tokens every query sees beside its window (streaming eviction).
    The engine frees pages behind the window with the same two numbers.
    mesh: the tensor-parallel mesh (None on one device): attention runs
    under shard_map over its "model" axis. platform: the platform the
    kernel is built for (None: jax's default backend; "tpu" / "gpu"
    to compile a Pallas kernel ahead of time without that device)."""

    backend: str = "auto"
    sliding_window: int | None = None
    num_sink_tokens: int = 0
    mesh: Any = None
    platform: str | None = None
    ring_pages: int = 0  # hybrid pool: pages per sequence's ring of sliding-layer pages (0: off)
    local_layers: tuple[int, ...] = ()  # hybrid pool: the layers whose pages are rings
    score_rows: int | None = None  # importance eviction: most rows a step scores (None: all)

    def fingerprint(self) -> tuple:
        """What a compiled program depends on (the mesh by its shape)."""
        mesh = (
            None if self.mesh is None else (tuple(self.mesh.shape.items()), self.mesh.devices.shape)
        )
        return (
            self.backend,
            self.sliding_window,
            self.num_sink_tokens,
            mesh,
            self.platform,
            self.ring_pages,
            self.local_layers,
            self.score_rows,
        )

    @classmethod
    def for_engine(cls, model: ModelConfig, engine: EngineConfig, mesh=None) -> AttentionSpec:
        """The one place the engine's window is decided: the model's own
        when every layer slides the same one (Mistral's `sliding_window`), or
        streaming eviction's recent window beside a few sink tokens. A model
        whose layers differ (Gemma's sliding and global layers) frees no page
        behind a window: each layer applies its own (`layer_window`), and the
        engine's hybrid pool, when on, gives the sliding layers rings."""
        _check_kv_format(engine, mesh)
        if engine.kv_eviction in ("snapkv", "h2o"):
            if any(w is not None for w in model.windows):
                raise ValueError(
                    f"kv_eviction={engine.kv_eviction!r}: this model's layers "
                    f"slide a window; importance eviction runs on models without one"
                )
            rows = (
                engine.max_num_seqs * engine.snapkv_window
                if engine.kv_eviction == "snapkv"
                else None
            )
            return cls(engine.attention_backend, None, 0, mesh, score_rows=rows)
        if engine.kv_eviction == "streaming":
            return cls(
                engine.attention_backend, engine.streaming_window, engine.num_sink_tokens, mesh
            )
        return cls(engine.attention_backend, model.uniform_window, 0, mesh)

    def layer_window(self, own: int | None) -> tuple[int | None, int]:
        """(window, sink tokens) of a layer whose model window is `own`: the
        narrower of it and the engine's; sink tokens only with the engine's."""
        if own is not None and (self.sliding_window is None or own < self.sliding_window):
            return own, 0
        return self.sliding_window, self.num_sink_tokens


def _check_kv_format(engine: EngineConfig, mesh) -> None:
    """At engine start: the attention kernel this engine runs reads its KV
    format (else a ValueError naming both)."""
    from pallas_kernels.ragged_paged_attention import check_format, resolve

    kv = engine.kv_dtype or engine.dtype
    fmt = (
        "int4"
        if kv == "int4"
        else "int8"
        if kv == "int8"
        else "fp8"
        if kv.startswith("fp8")
        else "float"
    )
    import jax

    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    check_format(resolve(engine.attention_backend, platform=device.platform)[0], fmt, device)


class LocalBatch(NamedTuple):
    """The step metadata attention reads, for the sliding layers of a hybrid pool."""

    slot_mapping: Any
    kv_lens: Any
    block_tables: Any
    cu_q_lens: Any
    num_seqs: Any


def ring_pages(window: int, max_rows: int, page_size: int) -> int:
    """Pages of one sequence's ring: every key a step's queries may read
    (the window behind its first row) and every row it writes land on
    distinct pages when positions map to ring page (position // page_size)
    mod this many."""
    return -(-(window + max_rows - 1) // page_size) + 1


def local_view(batch, ring: int, page_size: int) -> LocalBatch:
    """A hybrid pool's view of a step for its sliding layers: sequence s's
    position p lives in local page ring_base[s] + (p // page_size) % ring,
    so its block table is that ring repeated (entries behind the window
    alias newer pages, and attention masks them by position); padding rows
    keep their trash slot. Computed on the device from `batch.ring_base`
    and positions, so multi-step decode programs need nothing more."""
    import jax.numpy as jnp

    T, S = batch.slot_mapping.shape[0], batch.kv_lens.shape[0]
    W = batch.block_tables.shape[1]
    base = batch.ring_base
    tables = base[:, None] + (jnp.arange(W, dtype=jnp.int32) % ring)[None, :]
    seq = jnp.clip(
        jnp.searchsorted(batch.cu_q_lens[1:], jnp.arange(T, dtype=jnp.int32), side="right"),
        0,
        S - 1,
    )
    pos = batch.positions
    slots = (base[seq] + (pos // page_size) % ring) * page_size + pos % page_size
    slots = jnp.where(batch.slot_mapping < page_size, batch.slot_mapping, slots)
    return LocalBatch(
        slots.astype(jnp.int32),
        batch.kv_lens,
        tables.astype(jnp.int32),
        batch.cu_q_lens,
        batch.num_seqs,
    )


def attend(
    q,
    k,
    v,
    cache: KVCache,
    layer: int,
    batch,
    spec: AttentionSpec,
    *,
    all_decode: bool | None = None,
    soft_cap: float | None = None,
    sm_scale: float | None = None,
    window: int | None = None,
    sinks=None,
):
    """Write this step's k, v [T, KVH, D] into layer `layer` of the cache at
    batch.slot_mapping, then attend q [T, H, D] to it -> (o [T, H, D], cache).
    `batch` carries slot_mapping [T], kv_lens [S], block_tables [S, W],
    cu_q_lens [S + 1] and num_seqs []; `all_decode` is the kernel's static
    hint (see there). The layer's own numerics: `sm_scale` (None:
    1/sqrt(D)), `soft_cap`, `window` (the model's window for this layer,
    joined with the engine's by `AttentionSpec.layer_window`), `sinks` [H]
    (learned sink logits). Under `spec.mesh` each shard writes and reads its
    own KV heads (q's heads, the sinks and the cache's split alike over "model")."""
    meta = (batch.slot_mapping, batch.kv_lens, batch.block_tables, batch.cu_q_lens, batch.num_seqs)
    arrays = layer_arrays(cache, layer)
    window, num_sink_tokens = spec.layer_window(window)
    fn = functools.partial(
        _write_and_attend,
        spec=spec,
        all_decode=all_decode,
        soft_cap=soft_cap,
        sm_scale=sm_scale or 1.0 / math.sqrt(q.shape[-1]),
        window=window,
        num_sink_tokens=num_sink_tokens,
    )
    if spec.mesh is not None:
        import jax
        from jax.sharding import PartitionSpec as P

        heads, rep = P(None, "model"), P()
        pages = tuple(None if a is None else P("model") for a in arrays)
        fn = jax.shard_map(
            fn,
            mesh=spec.mesh,
            in_specs=(heads, heads, heads, pages, rep, P() if sinks is None else P("model")),
            out_specs=(heads, pages),
            check_vma=False,
        )
    o, arrays = fn(q, k, v, arrays, meta, sinks)
    cache = replace_layer(cache, layer, *arrays)
    if cache.scores is not None:  # importance eviction: the attention each key receives
        from jaxkv.model.kv_scores import accumulate_scores

        acc = accumulate_scores(
            cache.scores[layer],
            q,
            arrays[0],
            arrays[2],
            batch,
            sm_scale=sm_scale or 1.0 / math.sqrt(q.shape[-1]),
            soft_cap=soft_cap,
            max_rows=spec.score_rows,
        )
        cache = dataclasses.replace(
            cache, scores=cache.scores[:layer] + (acc,) + cache.scores[layer + 1 :]
        )
    return o, cache


def _write_and_attend(
    q, k, v, arrays, meta, sinks, *, spec, all_decode, soft_cap, sm_scale, window, num_sink_tokens
):
    from pallas_kernels import ragged_paged_attention

    slots, kv_lens, block_tables, cu_q_lens, num_seqs = meta
    kp, vp, ks, vs = write_pages(*arrays, k, v, slots)
    kw = {"num_sink_tokens": num_sink_tokens} if num_sink_tokens else {}
    head_scale = None
    if ks is not None and ks.ndim == 1:  # fp8: per-KV-head scales, folded into q and out
        import jax.numpy as jnp

        G = q.shape[1] // ks.shape[0]
        q = (q.astype(jnp.float32) * jnp.repeat(ks, G)[None, :, None]).astype(q.dtype)
        head_scale = jnp.repeat(vs, G)[None, :, None]
    elif ks is not None:
        kw.update(k_scale=ks, v_scale=vs)
    if sinks is not None:
        kw.update(sinks=sinks)
    o = ragged_paged_attention(
        q,
        kp,
        vp,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=window,
        soft_cap=soft_cap,
        backend=spec.backend,
        all_decode=all_decode,
        platform=spec.platform,
        **kw,
    )
    if head_scale is not None:
        o = (o.astype(head_scale.dtype) * head_scale).astype(o.dtype)
    return o, (kp, vp, ks, vs)
