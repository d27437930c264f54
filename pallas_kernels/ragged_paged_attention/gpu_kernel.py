"""The body of the GPU kernel (`gpu.py` has the design, the `pallas_call`
and the public entry), read top-down: the kernel, then its named steps: the
page fetch of one KV block (`_load_kv_block`), one online-softmax step
(`_online_softmax_step`) and the write-back (`_write_back`); then how
queries are cut into work blocks (`work_blocks`). Learned sinks
(`sinks.py`) are the online softmax's start: m = sink, l = exp(sink - m).

Head dims travel as column parts: one part [.., D] for float, int8 and fp8
pages; for int4 pages two, channels [0, D/2) (the bytes' low nibbles) and
[D/2, D) (their high nibbles), so a packed row is unpacked without moving a
lane: the scores are the sum of two half-width products and the output
accumulates in two halves."""

from __future__ import annotations

import functools
import operator

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.kv_formats import INT4_OFFSET
from pallas_kernels.ragged_paged_attention.sinks import softmax_start

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def rpa_kernel(
    # inputs
    blk_seq_ref,  # [NB] sequence of each work block
    blk_row_ref,  # [NB] first token row of each work block
    blk_len_ref,  # [NB] rows of the block that belong to it (0: no work)
    kv_lens_ref,  # [S]
    cu_q_lens_ref,  # [S + 1]
    block_tables_ref,  # [S, pages_per_seq_pad]
    sinks_ref,  # [KVH, block_q * G_pad] f32: each row's sink logit (-inf: none)
    q_ref,  # [T + block_q, KVH, G_pad, D] (whole array)
    k_ref,  # [P, page_size, D] (this KV head; int4: uint8 [P, page_size, D // 2])
    v_ref,
    k_scale_ref,  # [P, page_size] (int8: float32, int4: bfloat16) or None
    v_scale_ref,
    # outputs
    o_ref,  # [T + block_q, KVH, G_pad, D] (this split)
    lse_ref,  # [T + block_q, KVH, G_pad] or None (this split)
    *,
    block_q: int,
    group: int,
    pages_per_block: int,
    num_splits: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, _, g_pad, head_dim = q_ref.shape
    page_size = k_ref.shape[1]
    block_kv = pages_per_block * page_size
    rows = block_q * g_pad

    seq = blk_seq_ref[b]
    row0 = blk_row_ref[b]
    n_tok = blk_len_ref[b]
    kv_len = kv_lens_ref[seq]
    q_start = cu_q_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - q_start
    pos0 = kv_len - q_len + (row0 - q_start)  # position of the block's first row
    kv_hi = pos0 + n_tok  # one past the last row's position (<= kv_len)
    kv_lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    kb_lo = kv_lo // block_kv
    kb_hi = jnp.where(n_tok > 0, pl.cdiv(kv_hi, block_kv), kb_lo)
    per_split = pl.cdiv(kb_hi - kb_lo, num_splits)
    kb_start = jnp.minimum(kb_lo + split * per_split, kb_hi)
    kb_stop = jnp.minimum(kb_start + per_split, kb_hi)
    n_pages = pl.cdiv(kv_hi, page_size)

    tok = lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // g_pad  # row -> token
    q_pos = pos0 + tok
    row_live = tok < n_tok
    if g_pad != group:
        row_live = row_live & (lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) % g_pad < group)
    part = k_ref.shape[2]  # channels per column part: D, or D // 2 for int4
    q = tuple(
        q_ref[pl.ds(row0, block_q), h, :, pl.ds(c, part)].reshape(rows, part)
        for c in range(0, head_dim, part)
    )

    def body(kb, carry):
        k, v, k_scale, v_scale = _load_kv_block(
            k_ref,
            v_ref,
            k_scale_ref,
            v_scale_ref,
            block_tables_ref,
            seq,
            kb,
            pages_per_block,
            n_pages,
            kv_hi,
            q_ref.dtype,
        )
        key = kb * block_kv + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        mask = row_live & (key <= q_pos)
        if sliding_window is not None:
            mask = mask & (key > q_pos - sliding_window)
        return _online_softmax_step(
            carry, q, k, v, k_scale, v_scale, mask, sm_scale=sm_scale, soft_cap=soft_cap
        )

    acc = tuple(jnp.zeros((rows, part), jnp.float32) for _ in q)
    m, l = softmax_start(sinks_ref[h, :], MASK_VALUE)
    acc, m, l = lax.fori_loop(kb_start, kb_stop, body, (acc, m, l))

    _write_back(o_ref, lse_ref, acc, m, l, row0=row0, h=h, n_tok=n_tok, block_q=block_q)


def _load_kv_block(
    k_ref,
    v_ref,
    k_scale_ref,
    v_scale_ref,
    block_tables_ref,
    seq,
    kb,
    pages_per_block,
    n_pages,
    kv_hi,
    dtype,
):
    """The page fetch: K and V of KV block kb of sequence `seq` gathered
    through its block table (entries past its pages read page 0) at their
    stored width, as column parts [block_kv, part] of `dtype` (`_values`),
    and the scales as float32 [1, block_kv] rows (None without scales).
    Slots past the causal end may hold anything: float and fp8 values there
    are zeroed, integer pages hold no NaN and their value scales are zeroed."""
    page_size, width = k_ref.shape[1], k_ref.shape[2]
    block_kv = pages_per_block * page_size
    page_idx = kb * pages_per_block + jnp.arange(pages_per_block)
    pages = block_tables_ref[seq, pl.ds(kb * pages_per_block, pages_per_block)]
    pages = jnp.where(page_idx < n_pages, pages, 0)  # never follow unused entries
    k = _values(k_ref[pages].reshape(block_kv, width), dtype)
    v = _values(v_ref[pages].reshape(block_kv, width), dtype)
    if k_scale_ref is None:
        key_col = kb * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, width), 0)
        return k, tuple(jnp.where(key_col < kv_hi, x, jnp.zeros_like(x)) for x in v), None, None
    k_scale = k_scale_ref[pages].reshape(1, block_kv).astype(jnp.float32)
    v_scale = v_scale_ref[pages].reshape(1, block_kv).astype(jnp.float32)
    key_row = kb * block_kv + lax.broadcasted_iota(jnp.int32, (1, block_kv), 1)
    return k, v, k_scale, jnp.where(key_row < kv_hi, v_scale, 0.0)


def _values(x, dtype):
    """Stored rows [block_kv, width] -> their (unscaled) values in `dtype` as
    column parts: int4's uint8 bytes give two, their low nibbles (channels
    [0, D/2)) and high nibbles ([D/2, D)), each nibble - 7.5 (exact in
    bfloat16 / float16); int8 and fp8 (Triton's native fp8 conversion,
    sm_89+) and float pages one, a cast."""
    if x.dtype != jnp.uint8:
        return (x.astype(dtype),)
    return tuple((n.astype(jnp.float32) - INT4_OFFSET).astype(dtype) for n in (x & 15, x >> 4))


def _online_softmax_step(carry, q, k, v, k_scale, v_scale, mask, *, sm_scale, soft_cap):
    """Fold one KV block (column parts of q [rows, part], k, v [block_kv,
    part]) into the rows' (acc parts [rows, part], m, l [rows]) state."""
    acc, m, l = carry
    dtype = q[0].dtype
    precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
    s = (
        functools.reduce(
            operator.add,
            [
                lax.dot_general(
                    qc,
                    kc,
                    (((1,), (1,)), ((), ())),
                    precision=precision,
                    preferred_element_type=jnp.float32,
                )
                for qc, kc in zip(q, k)
            ],
        )
        * sm_scale
    )  # [rows, block_kv]
    if k_scale is not None:
        s = s * k_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_next)
    p = jnp.where(mask, jnp.exp(s - m_next[:, None]), 0.0)
    l_next = alpha * l + jnp.sum(p, axis=1)
    if v_scale is not None:
        p = p * v_scale  # unwritten slots' scales were zeroed
    p = p.astype(dtype)
    acc = tuple(
        a * alpha[:, None]
        + lax.dot_general(
            p, vc, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )
        for a, vc in zip(acc, v)
    )
    return acc, m_next, l_next


def _write_back(o_ref, lse_ref, acc, m, l, *, row0, h, n_tok, block_q):
    """Store the normalized rows of this block's tokens, each column part
    [rows, part] of acc in its columns (and their log-sum-exp when context
    splits are merged afterwards)."""
    rows, part = acc[0].shape
    g_pad = rows // block_q
    live = l > 0.0
    l_safe = jnp.where(live, l, 1.0)[:, None]
    tok_live = lax.broadcasted_iota(jnp.int32, (block_q, g_pad), 0) < n_tok
    mask = jnp.broadcast_to(tok_live[:, :, None], (block_q, g_pad, part))
    for i, a in enumerate(acc):
        plgpu.store(
            o_ref.at[pl.ds(row0, block_q), h, :, pl.ds(i * part, part)],
            (a / l_safe).reshape(block_q, g_pad, part).astype(o_ref.dtype),
            mask=mask,
        )
    if lse_ref is not None:
        lse = jnp.where(live, m + jnp.log(jnp.where(live, l, 1.0)), -jnp.inf)
        plgpu.store(
            lse_ref.at[pl.ds(row0, block_q), h, :], lse.reshape(block_q, g_pad), mask=tok_live
        )


def work_blocks(cu_q_lens, num_seqs, *, block_q, num_blocks):
    """Query work blocks that never span two sequences: (seq, first row, rows)
    each [num_blocks]; blocks past the last carry 0 rows."""
    S = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(S) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    b = jnp.arange(num_blocks)
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right"), S - 1).astype(jnp.int32)
    local = b - (ends[seq] - blocks[seq])
    row0 = cu_q_lens[seq] + local * block_q
    n = jnp.clip(q_lens[seq] - local * block_q, 0, block_q)
    n = jnp.where(b < ends[-1], n, 0).astype(jnp.int32)
    return seq, jnp.where(n > 0, row0, 0).astype(jnp.int32), n
