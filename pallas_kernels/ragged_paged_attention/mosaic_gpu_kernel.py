"""The body of the Mosaic GPU (Hopper) kernel (`mosaic_gpu.py` has the
design, the `plgpu.kernel` call and the public entry), read top-down: the
kernel, then its named steps: the TMA page fetch of one KV block
(`_fetch_kv_block`), the dequantization of fp8 / int8 / int4 tiles
(`_dequantize`), the score product (`_scores`), the online-softmax step
(`_softmax_step`), the value product (`_values`) and the clean-up of dead
value rows of float pages (`_zero_dead_values`). Learned sinks (`sinks.py`)
are the online softmax's start: m = sink, l = exp(sink - m).

Head dims travel as column parts (`q_smem` [n_parts, ROWS, part]): one
part of D for float, fp8 and int8 pages; two of D / 2 for int4 pages, the
channels of the bytes' low nibbles [0, D/2) and high nibbles [D/2, D), so a
packed row is unpacked without moving a lane: the scores are the sum of one
wgmma per part and the output accumulates per part."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.ragged_paged_attention.kv_formats import INT4_OFFSET
from pallas_kernels.ragged_paged_attention.sinks import softmax_start

try:
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # reported by mosaic_gpu.py at call time
    plgpu = None

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
ROWS = 64  # query rows of one program: the M of one warpgroup's wgmma
NUM_SLOTS = 2  # KV blocks in flight: the one computed on and the one being fetched

# Per work block metadata, one int32 row of `meta` [NB, META_FIELDS].
SEQ, POS0, KV_HI, KB_LO, KB_HI = range(5)
META_FIELDS = 5


def rpa_kernel(
    # inputs (GMEM)
    meta_ref,  # [NB, META_FIELDS] int32: sequence, first row's position, kv_hi, KV block range
    tables_ref,  # [S, pages_per_seq_pad] int32
    sinks_ref,  # [KVH, ROWS] f32: each row's sink logit (-inf: none)
    q_ref,  # [NB, KVH, n_parts, ROWS, part] the work blocks' queries, rows (token, group)
    #         token major, head dim in column parts
    k_ref,  # [KVH, P, page_size, width] (width: D, or D // 2 bytes for int4)
    v_ref,
    k_scale_ref,  # [KVH, S, KB, block_kv] (int8: f32, int4: bf16) per KV block, or None
    v_scale_ref,
    # output (GMEM)
    o_ref,  # [NB, KVH, n_parts, ROWS, part]
    # scratch (SMEM)
    q_smem,  # [n_parts, ROWS, part]; holds the output at the end
    k_smem,  # [NUM_SLOTS, block_kv, width] as stored
    v_smem,
    ks_smem,  # [NUM_SLOTS, block_kv] scales, or None
    vs_smem,
    kc_smem,  # [n_parts, block_kv, part] dequantized K in q's dtype, or None (float pages)
    vc_smem,
    p_smem,  # [ROWS, block_kv] probabilities, the A operand of the value product
    kt_smem,  # [n_parts, part, block_kv] K transposed (interpret mode) or None
    sink_smem,  # [ROWS] f32
    q_bar,
    sink_bar,
    k_bars,  # [NUM_SLOTS], one arrival per page copy (and one for the block's scales)
    v_bars,
    *,
    page_size: int,
    group_pad: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpret: bool,
):
    """One program: work block `b` (up to ROWS // group_pad tokens of one
    sequence) x KV head `h`, all group_pad query heads of that KV head.
    Loops over the block's visible KV blocks [kb_lo, kb_hi), fetching block
    j + 1 by TMA while block j is computed on (fp8 / int8 / int4 blocks are
    dequantized into kc_smem / vc_smem once they have landed). `interpret`:
    running in jax's Mosaic GPU interpret mode (see `_layout` and `_scores`)."""
    layout = functools.partial(_layout, interpret=interpret)
    b, h = lax.axis_index("block"), lax.axis_index("kv_head")
    block_kv = k_smem.shape[1]
    seq = meta_ref[b, SEQ]
    pos0 = meta_ref[b, POS0]  # position of the block's first token
    kv_hi = meta_ref[b, KV_HI]  # one past the last token's position
    kb_lo = meta_ref[b, KB_LO]
    kb_hi = meta_ref[b, KB_HI]
    kv_lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    n_pages = (kv_hi + page_size - 1) // page_size

    def fetch(kb, slot):
        _fetch_kv_block(
            (k_ref, k_scale_ref, k_smem, ks_smem, k_bars),
            (v_ref, v_scale_ref, v_smem, vs_smem, v_bars),
            tables_ref,
            seq=seq,
            h=h,
            kb=kb,
            slot=slot,
            n_pages=n_pages,
        )

    def operand(raw_smem, scale_smem, out_smem, kb, slot):
        """The block's K or V as column parts, wgmma operands in SMEM: the
        stored tile itself (float pages) or its dequantized copy."""
        if out_smem is None:
            return (raw_smem.at[slot],)
        _dequantize(
            raw_smem.at[slot],
            None if scale_smem is None else scale_smem.at[slot],
            out_smem,
            kb * block_kv,
            kv_lo,
            kv_hi,
            layout,
        )
        return tuple(out_smem.at[i] for i in range(out_smem.shape[0]))

    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, q_bar)
    plgpu.copy_gmem_to_smem(sinks_ref.at[h], sink_smem, sink_bar)

    @pl.when(kb_lo < kb_hi)
    def _():
        fetch(kb_lo, 0)

    plgpu.barrier_wait(q_bar)

    # Row r holds token r // group_pad of the block (query head r % group_pad).
    shape = (ROWS, block_kv)
    q_pos = pos0 + layout(lax.broadcasted_iota(jnp.int32, shape, 0), WGMMA) // group_pad
    key_in_block = layout(lax.broadcasted_iota(jnp.int32, shape, 1), WGMMA)

    def body(kb, carry):
        slot = lax.rem(kb - kb_lo, NUM_SLOTS)

        @pl.when(kb + 1 < kb_hi)
        def _():
            fetch(kb + 1, 1 - slot)

        key = kb * block_kv + key_in_block
        mask = (key <= q_pos) & (key < kv_hi)
        if sliding_window is not None:
            mask = mask & (key > q_pos - sliding_window)
        plgpu.barrier_wait(k_bars.at[slot])
        k = operand(k_smem, ks_smem, kc_smem, kb, slot)
        s = _scores(q_parts, k, kt_smem) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        carry, p = _softmax_step(carry, s, mask)
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_bars.at[slot])
        if vc_smem is None:
            # Only the first and last KV blocks can hold slots outside [kv_lo, kv_hi).
            @pl.when((kb * block_kv < kv_lo) | ((kb + 1) * block_kv > kv_hi))
            def _():
                _zero_dead_values(v_smem.at[slot], kb * block_kv, kv_lo, kv_hi, layout)

        v = operand(v_smem, vs_smem, vc_smem, kb, slot)
        acc, m, l = carry
        return tuple(a + x for a, x in zip(acc, _values(p_smem, v, acc[0].shape))), m, l

    n_parts, _, part = q_smem.shape
    q_parts = tuple(q_smem.at[i] for i in range(n_parts))
    acc = tuple(layout(jnp.zeros((ROWS, part), jnp.float32), WGMMA) for _ in q_parts)
    plgpu.barrier_wait(sink_bar)
    m, l = softmax_start(layout(sink_smem[...], WGMMA_ROW), MASK_VALUE)
    acc, m, l = lax.fori_loop(kb_lo, kb_hi, body, (acc, m, l))

    # Rows that saw no key (empty blocks, padding rows) have acc == 0, and
    # l == 0 without a sink: write 0.
    inv_l = jnp.where(l > 0.0, 1.0 / jnp.where(l > 0.0, l, 1.0), 0.0)
    for q_part, a in zip(q_parts, acc):
        q_part[...] = (a * lax.broadcast_in_dim(inv_l, a.shape, [0])).astype(q_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, h])
    plgpu.wait_smem_to_gmem(0)


WGMMA, WGMMA_ROW = "wgmma", "wgmma_row"


def _layout(x, which, *, interpret):
    """Give a register array wgmma's fragment layout (WGMMA) or that of
    its per-row reductions (WGMMA_ROW), so loop carries and operands agree.
    A layout means nothing on CPU and jax 0.10's interpret mode has no rule
    for layout_cast, so there x is returned as is."""
    if interpret:
        return x
    target = plgpu.Layout.WGMMA if which == WGMMA else plgpu.Layout.WGMMA.reduce(1)
    return plgpu.layout_cast(x, target)


def _fetch_kv_block(k, v, tables_ref, *, seq, h, kb, slot, n_pages):
    """Start the TMA copies of KV block kb of sequence `seq`, K and V each
    given as (pages, scales or None, tiles, scale tiles or None, barriers):
    one copy per page into consecutive rows of the slot and one of the
    block's scales, on the slot's barrier (one arrival per copy). Table
    entries past the sequence's pages are not followed: page 0 (the trash
    page) is read instead."""
    page_size = k[0].shape[2]
    pages_per_block = k[2].shape[1] // page_size
    for i in range(pages_per_block):
        idx = kb * pages_per_block + i
        page = jnp.where(idx < n_pages, tables_ref[seq, idx], 0)
        rows = pl.ds(i * page_size, page_size)
        for pages, _, tiles, _, bars in (k, v):
            plgpu.copy_gmem_to_smem(pages.at[h, page], tiles.at[slot, rows], bars.at[slot])
    for _, scales, _, scale_tiles, bars in (k, v):
        if scales is not None:
            plgpu.copy_gmem_to_smem(scales.at[h, seq, kb], scale_tiles.at[slot], bars.at[slot])


def _dequantize(raw, scale, out, key0, kv_lo, kv_hi, layout):
    """A stored tile raw [block_kv, width] (fp8, int8, or int4's uint8
    bytes) -> its values in out [n_parts, block_kv, part] (q's dtype), for
    wgmma: in registers, float32 (fp8 through float16, exact), times the
    token's scale [block_kv] when there is one; int4's low nibbles give part
    0, its high nibbles part 1, each nibble - 7.5. Rows of keys outside
    [kv_lo, kv_hi) are zeroed: unwritten slots may hold NaN (fp8) or NaN
    scales, and a masked probability of 0 times NaN would reach the output."""
    x = layout(raw[...], WGMMA)
    if raw.dtype == jnp.uint8:  # int4; Mosaic GPU shifts no 8-bit integers
        x = x.astype(jnp.int32)
        parts = [(n.astype(jnp.float32) - INT4_OFFSET) for n in (x & 15, x >> 4)]
    else:
        parts = [x.astype(jnp.float32)]
    if scale is not None:
        col = layout(scale[...], WGMMA_ROW).astype(jnp.float32)
        parts = [v * lax.broadcast_in_dim(col, v.shape, [0]) for v in parts]
    key = key0 + layout(lax.broadcasted_iota(jnp.int32, parts[0].shape, 0), WGMMA)
    live = (key >= kv_lo) & (key < kv_hi)
    for i, v in enumerate(parts):
        out.at[i][...] = jnp.where(live, v, 0.0).astype(out.dtype)
    plgpu.commit_smem()


def _scores(q_parts, k_parts, kt_smem):
    """S = sum over column parts of Q K^T, [ROWS, block_kv] float32, by
    wgmma, operands in SMEM. On the GPU the B operand is the K tile's
    transposed view (wgmma reads it K-major). jax 0.10's interpret mode
    cannot read a transposed SMEM view in wgmma, so there (kt_smem given)
    each part is transposed through registers into kt_smem first; the
    product is the same."""
    if kt_smem is None:
        rhs = [plgpu.transpose_ref(k, (1, 0)) for k in k_parts]
    else:
        for i, k in enumerate(k_parts):
            kt_smem.at[i][...] = k[...].T
        plgpu.commit_smem()
        rhs = [kt_smem.at[i] for i in range(len(k_parts))]

    def product(acc_ref):
        for q, k in zip(q_parts, rhs):
            plgpu.wgmma(acc_ref, q, k)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((ROWS, k_parts[0].shape[0]), jnp.float32))


def _softmax_step(carry, s, mask):
    """Fold the masked scores s [ROWS, block_kv] into the running max m and
    sum l [ROWS]; rescale the acc parts. Returns the new carry and the
    block's probabilities p (exactly 0 where masked, also in rows that saw no key yet)."""
    acc, m, l = carry
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_next)
    p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0])), 0.0)
    l_next = l * alpha + p.sum(axis=1)
    acc = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in acc)
    return (acc, m_next, l_next), p


def _values(p_smem, v_parts, shape):
    """P V per column part, each [ROWS, part] float32 by wgmma (P and V from SMEM)."""

    def product(v, acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v)
        return acc_ref[...]

    return tuple(
        pl.run_scoped(functools.partial(product, v), plgpu.ACC(shape, jnp.float32)) for v in v_parts
    )


def _zero_dead_values(v_tile, key0, kv_lo, kv_hi, layout):
    """Zero the value rows of keys outside [kv_lo, kv_hi): unwritten slots
    (and pages behind the window) may hold anything, NaN included, and a
    masked probability of 0 times NaN would still reach the output."""
    v = v_tile[...]
    key = key0 + layout(lax.broadcasted_iota(jnp.int32, v.shape, 0), WGMMA)
    v_tile[...] = jnp.where((key >= kv_lo) & (key < kv_hi), v, jnp.zeros_like(v))
    plgpu.commit_smem()
