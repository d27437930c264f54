"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Same contract and numbers as `reference.py` (see its module docstring):
q [T, H, D], k_pages / v_pages [KVH, P, page_size, D] -> [T, H, D].

Design
------
Grid ``(KVH, T_pad // block_q)``: one cell owns one KV head and one aligned
block of ``block_q`` query tokens, for *all* G = H // KVH query heads of that
KV head (GQA without copying K/V). The wrapper lays q out as
``[KVH, T_pad * G, D]`` (rows ordered token-major, head-minor), so a cell's
queries are one ``[block_q * G, D]`` VMEM tile and a decode row block is G
useful rows of the MXU instead of one.

A query block may hold rows of several sequences (ragged batch: many decodes
share a block, a prefill chunk may span several blocks). The cell walks those
sequences in order; for each it streams only the KV blocks its rows can see
(causal end, sliding-window start) through VMEM. The online-softmax state
(m, l, acc) is per row, and rows of other sequences are masked to probability
zero, so one state tile serves every sequence of the block and the output tile
is written exactly once. Rows of no sequence end with l = 0 and come out as 0.

Memory:
  SMEM (scalar prefetch): kv_lens [S], block_tables flattened [S * pages_per_seq],
    cu_q_lens [S + 1], num_seqs [1], first_seq [T_pad // block_q] (the first
    sequence whose rows reach each query block).
  HBM (memory_space ANY): k_pages, v_pages, k_scale, v_scale; pages are copied
    one DMA per page into
  VMEM: k/v buffers [2, pages_per_block, page_size, D] (double buffered: the
    next KV block, possibly the next sequence's first, is in flight while the
    current one is computed), scale buffers [2, pages_per_block, page_size] f32,
    m / l [block_q * G, 128] f32 (lane-replicated), acc [block_q * G, D] f32, and
    the q / out tiles managed by the BlockSpec pipeline.

No cell depends on another (no state crosses grid steps), so both grid axes
are "parallel" and megacore chips may split them.

Numerics: scores in float32 (matmul accumulates in f32, f32 inputs use
HIGHEST precision), masked entries contribute exactly zero (never 0 * NaN, so
unwritten page slots may hold anything). int8 pages are cast to the query
dtype in VMEM and their per-token scales applied to the score / probability
columns (s * k_scale, p * v_scale), which equals dequantizing K and V.

Constraints (checked with ValueError): page_size % 8 == 0; D % 64 == 0;
block_q * G % 16 == 0 (default block_q 16 always fits); q float32 or
bfloat16; pages in q's dtype or int8 with scales. ``block_tables`` is copied
to SMEM, so S * pages_per_seq int32 must fit there (keep it well under 1 MiB,
i.e. < ~200K entries with the other tables). VMEM use is about
4 * pages_per_block * page_size * D * itemsize (K/V double buffers) plus
(block_q * G) * (D + 256) * 4 bytes; the default 256-token KV block stays far
below the default scoped-VMEM limit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.checks import check_inputs

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LANES = 128


def _lane_bcast(x, n):
    """[R, 128] lane-replicated row statistic -> [R, n]."""
    if n == _LANES:
        return x
    if n < _LANES:
        return x[:, :n]
    return jnp.tile(x, (1, n // _LANES))


def _flatten_pages(x, dtype):
    """[pages, page_size, D] -> [pages * page_size, D] in `dtype`. Sub-32-bit
    dtypes pack rows into sublanes, so a page that is not a whole number of
    packed tiles is merged in float32 (always tile-aligned for page_size % 8)."""
    pages, page_size, d = x.shape
    packing = 4 // x.dtype.itemsize
    if page_size % (8 * packing):
        x = x.astype(jnp.float32)
    return x.reshape(pages * page_size, d).astype(dtype)


def _scale_row(scales, live):
    """[pages, page_size] per-token scales -> [1, pages * page_size] lane row,
    via a one-hot matmul (exact at HIGHEST precision) instead of a lane-merging
    reshape. Slots where `live` is False become 0 first: one NaN would spread
    along its page row through the matmul."""
    pages, page_size = scales.shape
    scales = jnp.where(live, scales, 0.0)
    n = pages * page_size
    col = lax.broadcasted_iota(jnp.int32, (page_size, n), 1)
    sel = (col % page_size == lax.broadcasted_iota(jnp.int32, (page_size, n), 0))
    tiled = jnp.dot(scales, sel.astype(jnp.float32), precision=lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)  # [pages, n]: scales[j, n % ps]
    own = (lax.broadcasted_iota(jnp.int32, (pages, n), 1) // page_size
           == lax.broadcasted_iota(jnp.int32, (pages, n), 0))
    return jnp.sum(jnp.where(own, tiled, 0.0), axis=0, keepdims=True)


def _rpa_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S]
    block_tables_ref,  # [S * pages_per_seq]
    cu_q_lens_ref,  # [S + 1]
    num_seqs_ref,  # [1]
    first_seq_ref,  # [num_q_blocks]
    # inputs
    q_ref,  # [R, D] VMEM, R = block_q * G
    k_hbm,  # [KVH, P, page_size, D] HBM
    v_hbm,
    k_scale_hbm,  # [KVH, P, page_size] HBM, or None
    v_scale_hbm,
    # output
    o_ref,  # [R, D]
    # scratch
    k_buf,  # [2, pages_per_block, page_size, D]
    v_buf,
    ks_buf,  # [2, pages_per_block, page_size] f32, or None
    vs_buf,
    sems,  # DMA [2 slots, 4 (k, v, k_scale, v_scale)]
    m_ref,  # [R, 128] f32
    l_ref,  # [R, 128] f32
    acc_ref,  # [R, D] f32
    *,
    block_q: int,
    group: int,
    pages_per_seq: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    h = pl.program_id(0)
    qb = pl.program_id(1)
    rows, head_dim = q_ref.shape
    pages_per_block, page_size = k_buf.shape[1], k_buf.shape[2]
    block_kv = pages_per_block * page_size
    num_seqs = num_seqs_ref[0]
    blk_start = qb * block_q
    blk_end = blk_start + block_q
    quantized = ks_buf is not None
    compute_dtype = q_ref.dtype

    m_ref[...] = jnp.full(m_ref.shape, _MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_in_block(s):
        return jnp.logical_and(s < num_seqs, cu_q_lens_ref[jnp.minimum(s, num_seqs)] < blk_end)

    def seq_span(s):
        """Token rows [t0, t1) of sequence s inside this block, the position of
        its first row and its KV block range [kb_lo, kb_hi) (empty if no rows)."""
        q_start, q_end = cu_q_lens_ref[s], cu_q_lens_ref[s + 1]
        t0 = jnp.maximum(q_start, blk_start)
        t1 = jnp.minimum(q_end, blk_end)
        pos0 = kv_lens_ref[s] - (q_end - q_start) + (t0 - q_start)
        kv_hi = pos0 + (t1 - t0)  # one past the last row's position
        kv_lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
        kb_lo = kv_lo // block_kv
        kb_hi = jnp.where(t1 > t0, pl.cdiv(kv_hi, block_kv), kb_lo)
        return t0, t1, pos0, kv_hi, kb_lo, kb_hi

    def next_seq_with_work(s):
        def cond(s):
            _, _, _, _, kb_lo, kb_hi = seq_span(jnp.clip(s, 0, jnp.maximum(num_seqs - 1, 0)))
            return jnp.logical_and(seq_in_block(s), kb_hi <= kb_lo)
        return lax.while_loop(cond, lambda s: s + 1, s)

    def copies(s, kb, slot):
        """(predicate, descriptor) for each page DMA of KV block kb of seq s:
        only pages holding keys some row of this block may see are copied."""
        _, _, _, kv_hi, _, _ = seq_span(s)
        n_pages = pl.cdiv(kv_hi, page_size)
        out = []
        for j in range(pages_per_block):
            p = kb * pages_per_block + j
            live = p < n_pages
            page = block_tables_ref[s * pages_per_seq + jnp.minimum(p, pages_per_seq - 1)]
            out.append((live, pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[slot, j],
                                                    sems.at[slot, 0])))
            out.append((live, pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot, j],
                                                    sems.at[slot, 1])))
            if quantized:
                out.append((live, pltpu.make_async_copy(
                    k_scale_hbm.at[h, pl.ds(page, 1)], ks_buf.at[slot, pl.ds(j, 1)],
                    sems.at[slot, 2])))
                out.append((live, pltpu.make_async_copy(
                    v_scale_hbm.at[h, pl.ds(page, 1)], vs_buf.at[slot, pl.ds(j, 1)],
                    sems.at[slot, 3])))
        return out

    def start(s, kb, slot):
        for live, cp in copies(s, kb, slot):
            pl.when(live)(cp.start)

    def wait(s, kb, slot):
        for live, cp in copies(s, kb, slot):
            pl.when(live)(cp.wait)

    def attend(s, kb, slot):
        """One online-softmax step: rows of sequence s against KV block kb."""
        t0, t1, pos0, _, _, _ = seq_span(s)
        row_tok = blk_start + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // group
        key = kb * block_kv + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        q_pos = pos0 + (row_tok - t0)
        mask = (row_tok >= t0) & (row_tok < t1) & (key <= q_pos)
        if sliding_window is not None:
            mask = mask & (key > q_pos - sliding_window)

        k = _flatten_pages(k_buf[slot], compute_dtype)  # [block_kv, D]
        v = _flatten_pages(v_buf[slot], compute_dtype)
        # Keys past the causal end were never copied (stale VMEM) or are unwritten
        # slots: zero them so 0-probability * garbage stays 0.
        v_live = (kb * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0)
                  < pos0 + (t1 - t0))
        v = jnp.where(v_live, v, jnp.zeros_like(v))
        precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

        s_ = lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32) * sm_scale  # [R, block_kv]
        if quantized:
            slot_key = (kb * block_kv + page_size
                        * lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 0)
                        + lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 1))
            scale_live = slot_key < pos0 + (t1 - t0)
            s_ = s_ * _scale_row(ks_buf[slot], scale_live)
        if soft_cap is not None:
            s_ = soft_cap * jnp.tanh(s_ / soft_cap)
        s_ = jnp.where(mask, s_, _MASK_VALUE)

        m_prev = m_ref[...]  # [R, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s_, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s_ - m_next[:, :1]), 0.0)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        if quantized:
            p = p * _scale_row(vs_buf[slot], scale_live)
        pv = jnp.dot(p.astype(compute_dtype), v, precision=precision,
                     preferred_element_type=jnp.float32)  # [R, D]
        acc_ref[...] = _lane_bcast(alpha, head_dim) * acc_ref[...] + pv

    def seq_body(carry):
        s, slot = carry
        _, _, _, _, kb_lo, kb_hi = seq_span(s)
        s_next = next_seq_with_work(s + 1)
        has_next_seq = seq_in_block(s_next)

        def kv_body(kb, slot):
            # Prefetch the next KV block: this sequence's, or the next one's first.
            last = kb + 1 == kb_hi
            fetch_s = jnp.where(last, jnp.minimum(s_next, num_seqs - 1), s)
            fetch_kb = jnp.where(last, seq_span(fetch_s)[4], kb + 1)

            @pl.when(jnp.logical_or(jnp.logical_not(last), has_next_seq))
            def _():
                start(fetch_s, fetch_kb, 1 - slot)

            wait(s, kb, slot)
            attend(s, kb, slot)
            return 1 - slot

        slot = lax.fori_loop(kb_lo, kb_hi, kv_body, slot)
        return s_next, slot

    s0 = next_seq_with_work(first_seq_ref[qb])

    @pl.when(seq_in_block(s0))
    def _():
        start(s0, seq_span(s0)[4], 0)

    lax.while_loop(lambda c: seq_in_block(c[0]), seq_body, (s0, 0))

    l = l_ref[...]
    inv = jnp.where(l > 0.0, 1.0 / jnp.where(l > 0.0, l, 1.0), 0.0)
    o_ref[...] = (acc_ref[...] * _lane_bcast(inv, head_dim)).astype(o_ref.dtype)


def _rpa_pallas_call(q_t, k_pages, v_pages, k_scale, v_scale, kv_lens, block_tables_flat,
                     cu_q_lens, num_seqs, first_seq, *, group, pages_per_seq, block_q,
                     pages_per_block, sm_scale, sliding_window, soft_cap, vmem_limit_bytes,
                     interpret):
    """q_t [KVH, T_pad * G, D] -> [KVH, T_pad * G, D]."""
    kvh, total_rows, head_dim = q_t.shape
    _, _, page_size, _ = k_pages.shape
    rows = block_q * group
    num_q_blocks = total_rows // rows
    quantized = k_scale is not None

    q_spec = pl.BlockSpec((None, rows, head_dim), lambda h, i, *_: (h, i, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kv_buf = pltpu.VMEM((2, pages_per_block, page_size, head_dim), k_pages.dtype)
    scale_buf = pltpu.VMEM((2, pages_per_block, page_size), jnp.float32) if quantized else None
    stat = pltpu.VMEM((rows, _LANES), jnp.float32)
    kernel = functools.partial(
        _rpa_kernel, block_q=block_q, group=group, pages_per_seq=pages_per_seq,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if not quantized:
        kernel = _with_none_args(kernel)
    scalars = (kv_lens, block_tables_flat, cu_q_lens, num_seqs, first_seq)
    operands = (q_t, k_pages, v_pages) + ((k_scale, v_scale) if quantized else ())
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(kvh, num_q_blocks),
            in_specs=[q_spec, hbm, hbm] + ([hbm, hbm] if quantized else []),
            out_specs=q_spec,
            scratch_shapes=[kv_buf, kv_buf] + ([scale_buf, scale_buf] if quantized else [])
            + [pltpu.SemaphoreType.DMA((2, 4)), stat, stat,
               pltpu.VMEM((rows, head_dim), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes),
        out_shape=jax.ShapeDtypeStruct(q_t.shape, q_t.dtype),
        interpret=interpret,
        name="jaxkv_ragged_paged_attention",
    )(*scalars, *operands)


def _with_none_args(kernel):
    """Adapts the kernel to a call without scale operands / scratch."""
    def wrapped(kv_lens, bt, cu, ns, fs, q, k, v, o, k_buf, v_buf, sems, m, l, acc):
        return kernel(kv_lens, bt, cu, ns, fs, q, k, v, None, None, o, k_buf, v_buf, None,
                      None, sems, m, l, acc)
    return wrapped


def _default_pages_per_block(page_size, pages_per_seq):
    return max(1, min(pages_per_seq, 256 // page_size))


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "block_q", "pages_per_block",
    "vmem_limit_bytes", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, k_scale=None,
                           v_scale=None, block_q=16, pages_per_block=None,
                           vmem_limit_bytes=None, interpret=False):
    """Ragged paged attention on TPU (contract: `reference.py`).

    q [T, H, D] float32/bfloat16; k_pages, v_pages [KVH, P, page_size, D] in
    q's dtype, or int8 with k_scale, v_scale [KVH, P, page_size] float32;
    kv_lens [S], block_tables [S, pages_per_seq], cu_q_lens [S + 1] int32;
    num_seqs [] or [1] int32 -> [T, H, D] in q's dtype.

    Static: sm_scale, sliding_window, soft_cap; tuning: block_q (query tokens per
    grid cell; block_q * G rows must be a multiple of 16), pages_per_block (pages
    per KV block; default 256 tokens' worth), vmem_limit_bytes; interpret (False,
    True or a `pltpu.InterpretParams`) runs the kernel on CPU with TPU semantics.
    """
    T, H, D, KVH, P, page_size, S = check_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
        q_dtypes=(jnp.float32, jnp.bfloat16), kernel="TPU")
    if D % 64:
        raise ValueError(f"TPU kernel needs head dim a multiple of 64, got {D}")
    if page_size % 8:
        raise ValueError(f"TPU kernel needs page_size a multiple of 8, got {page_size}")
    G = H // KVH
    if (block_q * G) % 16:
        raise ValueError(f"block_q * (H // KVH) = {block_q * G} must be a multiple of 16")
    pages_per_seq = block_tables.shape[1]
    if pages_per_block is None:
        pages_per_block = _default_pages_per_block(page_size, pages_per_seq)
    if not 0 < pages_per_block:
        raise ValueError(f"pages_per_block must be positive, got {pages_per_block}")
    if interpret is True:
        interpret = pltpu.InterpretParams()

    num_q_blocks = pl.cdiv(T, block_q)
    T_pad = num_q_blocks * block_q
    num_seqs = jnp.minimum(jnp.reshape(num_seqs, (1,)).astype(jnp.int32), S)
    # Layout: [KVH, T_pad * G, D], rows token-major so a q block is one tile.
    q_t = jnp.pad(q, ((0, T_pad - T), (0, 0), (0, 0)))
    q_t = q_t.reshape(T_pad, KVH, G, D).transpose(1, 0, 2, 3).reshape(KVH, T_pad * G, D)
    live_ends = jnp.where(jnp.arange(S) < num_seqs[0], cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    first_seq = jnp.searchsorted(live_ends, jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q,
                                 side="right").astype(jnp.int32)
    out = _rpa_pallas_call(
        q_t, k_pages, v_pages,
        None if k_scale is None else k_scale.astype(jnp.float32),
        None if v_scale is None else v_scale.astype(jnp.float32),
        kv_lens, block_tables.reshape(-1), cu_q_lens, num_seqs, first_seq,
        group=G, pages_per_seq=pages_per_seq, block_q=block_q,
        pages_per_block=pages_per_block, sm_scale=sm_scale, sliding_window=sliding_window,
        soft_cap=soft_cap, vmem_limit_bytes=vmem_limit_bytes, interpret=interpret)
    out = out.reshape(KVH, T_pad, G, D).transpose(1, 0, 2, 3).reshape(T_pad, H, D)
    return out[:T]
