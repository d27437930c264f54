"""The device side of importance eviction (`jaxkv.core.kv.evict` decides):
the attention each cached token receives, summed into the cache's
`scores` slots by a cheap pass beside whichever kernel attends, and the
compaction of a sequence's kept tokens into its first pages.

The pass (`accumulate_scores`) runs in every layer of a step when the cache
carries scores: rows at kv index >= `score_from[s]` of their sequence
(SnapKV: the prompt's last window; H2O: every row) are softmaxed against
their sequence's keys (causal, dequantized, the layer's scale and soft
cap), summed over the query heads of each KV head, and added to the slots
of the keys they read. Padding rows and the pages past a sequence's end
add nothing that is ever read (the trash page takes them).

Compaction (`compact_pages`) gathers, per layer and KV head, the kept
kv indices `src` of one sequence (its block table row `table`) and writes
them to kv indices 0, 1, ... of the same row: keys are stored after RoPE,
so a kept key means the same wherever it sits; positions (RoPE of the
sequence's next tokens) keep counting on the host (`Progress.evicted`).
Pages, int8 / int4 scales and the scores move alike; fp8's per-head scales
are not per token and stay.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.kv_formats import dequantize

NEVER = 1 << 30  # a score_from no row reaches


def _row_keys(kp, ks, table):
    """[KVH, W * page_size, D] float32 keys of one block table row `table` [W]."""
    KVH = kp.shape[0]
    if ks is not None and ks.ndim == 1:  # fp8: one scale per KV head
        k = dequantize(kp[:, table]) * ks[:, None, None, None]
    else:
        k = dequantize(kp[:, table], None if ks is None else ks[:, table])
    return k.reshape(KVH, -1, k.shape[-1])


def accumulate_scores(
    scores,
    q,
    kp,
    ks,
    batch,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    max_rows: int | None = None,
):
    """`scores` [KVH, P, page_size] plus the attention this step's scoring
    rows give each key of their sequence. q [T, H, D] (as attention takes
    it), kp / ks the layer's pages and scales after this step's writes;
    `batch` carries cu_q_lens, kv_lens, block_tables, num_seqs and
    score_from [S]. `max_rows` bounds the rows scored (static)."""
    T, H, D = q.shape
    KVH, _, ps = kp.shape[:3]
    S, W = batch.block_tables.shape
    G = H // KVH
    rows = jnp.arange(T, dtype=jnp.int32)
    cu = batch.cu_q_lens
    seq = jnp.clip(jnp.searchsorted(cu[1:], rows, side="right"), 0, S - 1)
    row_kv = batch.kv_lens[seq] - (cu[seq + 1] - rows)  # the row's own kv index
    live = (rows < cu[batch.num_seqs]) & (row_kv >= batch.score_from[seq])
    R = T if max_rows is None else min(T, max_rows)
    pick = jnp.argsort(~live, stable=True)[:R]  # the scoring rows first
    J = W * ps
    qs = q[pick].astype(jnp.float32).reshape(R, KVH, G, D)

    def one(args):  # one row against its sequence's keys (gathered per row: no [S, J] copy)
        qr, s, limit, ok = args
        keys = _row_keys(kp, ks, batch.block_tables[s])
        logits = jnp.einsum("kgd,kjd->kgj", qr, keys) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        seen = jnp.arange(J) <= limit
        logits = jnp.where(seen[None, None], logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1)
        return jnp.where(ok, p.sum(axis=1), 0.0)  # [KVH, J]

    got = jax.lax.map(one, (qs, seq[pick], row_kv[pick], live[pick]), batch_size=8)
    per_seq = jax.ops.segment_sum(got, seq[pick], num_segments=S)  # [S, KVH, J]
    j = jnp.arange(J)
    page = batch.block_tables[:, j // ps]  # [S, J]
    off = jnp.broadcast_to(j % ps, (S, J))
    add = jnp.moveaxis(per_seq, 1, 0)  # [KVH, S, J]
    return scores.at[:, page, off].add(add)


def gather_scores(cache, table):
    """[L, KVH, W * page_size] float32: the scores of block table row
    `table` [W], every layer."""
    return jnp.stack([x[:, table].reshape(x.shape[0], -1) for x in cache.scores])


def compact_pages(cache, table, src, n_keep):
    """`cache` with, in every layer l and KV head h, the keys, values, scales
    and scores at kv indices src[l, h, :n_keep] of row `table` [W] moved to
    kv indices 0 .. n_keep - 1 of the same row. src [L, KVH, B] int32 (B
    static); entries past n_keep write the trash page."""
    ps = cache.k[0].shape[2]
    B = src.shape[-1]
    j = jnp.arange(B)
    keep = j < n_keep
    dpage = jnp.where(keep, table[jnp.minimum(j // ps, table.shape[0] - 1)], 0)
    doff = jnp.where(keep, j % ps, 0)

    def move(t, per_head: bool = True):
        if t is None:
            return None
        out = []
        for l, x in enumerate(t):
            if x.ndim == 1:  # fp8's per-head scales
                out.append(x)
                continue
            KVH = x.shape[0]
            flat = x[:, table].reshape((KVH, -1) + x.shape[3:])
            idx = src[l].reshape((KVH, B) + (1,) * (flat.ndim - 2))
            kept = jnp.take_along_axis(flat, idx, axis=1)
            out.append(x.at[:, dpage, doff].set(kept))
        return tuple(out)

    return dataclasses.replace(
        cache,
        k=move(cache.k),
        v=move(cache.v),
        k_scale=move(cache.k_scale),
        v_scale=move(cache.v_scale),
        scores=move(cache.scores),
    )
