"""StepBatch, the fixed-shape metadata of one step, and the attention call.

Every array is int32 unless said otherwise; T tokens and S sequences are
padded up to a bucket, so a jitted step compiles once per bucket:

    token_ids[T]       input token of each row (0 for padding)
    positions[T]       absolute position of each row (RoPE)
    slot_mapping[T]    page * page_size + offset the row's K/V goes to
                       (padding rows point into the trash page 0)
    cu_q_lens[S+1]     rows of sequence s are cu_q_lens[s] : cu_q_lens[s+1]
    kv_lens[S]         tokens in the cache for s after this step's writes
    block_tables[S, W] pages of s in order (W pages_per_seq, bucketed)
    num_seqs[]         live sequences; the rest are padding
    logits_indices[S]  row whose logits are sampled for s (its last row)
    sampling           per-sequence sampling arrays (jaxkv.sampling)

A decode is a sequence with one row, a prefill chunk one with several; both
ride in the same step.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxkv.kv_cache import KVCache
from jaxkv.sampling import SamplingBatch

BACKENDS = ("auto", "reference", "pallas")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    token_ids: jax.Array
    positions: jax.Array
    slot_mapping: jax.Array
    cu_q_lens: jax.Array
    kv_lens: jax.Array
    block_tables: jax.Array
    num_seqs: jax.Array
    logits_indices: jax.Array
    sampling: SamplingBatch


def paged_attention(q, cache: KVCache, layer: int, batch: StepBatch, *, backend: str = "auto",
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    num_sink_tokens: int = 0):
    """q [T, H, D] against layer `layer` of the paged cache -> [T, H, D]."""
    from pallas_kernels import ragged_paged_attention

    kw = {"num_sink_tokens": num_sink_tokens} if num_sink_tokens else {}
    if cache.quantized:
        kw.update(k_scale=cache.k_scale[layer], v_scale=cache.v_scale[layer])
    return ragged_paged_attention(
        q, cache.k[layer], cache.v[layer], batch.kv_lens, batch.block_tables,
        batch.cu_q_lens, batch.num_seqs, sm_scale=1.0 / math.sqrt(q.shape[-1]),
        sliding_window=sliding_window, soft_cap=soft_cap, backend=backend, **kw)
