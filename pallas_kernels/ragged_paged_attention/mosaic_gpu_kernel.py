"""The body of the Mosaic GPU (Hopper) kernel (`mosaic_gpu.py` has the
design, the `plgpu.kernel` call and the public entry), read top-down: the
kernel, then its named steps: the TMA page fetch of one KV block
(`_fetch_kv_block`), the score product (`_scores`), the online-softmax
step (`_softmax_step`), the value product (`_values`) and the clean-up of
dead value rows (`_zero_dead_values`). Learned sinks (`sinks.py`) are the
online softmax's start: m = sink, l = exp(sink - m)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

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
    q_ref,  # [NB, KVH, ROWS, D] the work blocks' queries, rows (token, group) token major
    k_ref,  # [KVH, P, page_size, D]
    v_ref,
    # output (GMEM)
    o_ref,  # [NB, KVH, ROWS, D]
    # scratch (SMEM)
    q_smem,  # [ROWS, D]; holds the output at the end
    k_smem,  # [NUM_SLOTS, block_kv, D]
    v_smem,
    p_smem,  # [ROWS, block_kv] probabilities, the A operand of the value product
    kt_smem,  # [D, block_kv] K transposed through registers (interpret mode) or None
    sink_smem,  # [ROWS] f32
    q_bar,
    sink_bar,
    k_bars,  # [NUM_SLOTS], one arrival per page copy
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
    j + 1 by TMA while block j is computed on. `interpret`: running in jax's
    Mosaic GPU interpret mode (see `_layout` and `_scores`)."""
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
        _fetch_kv_block(k_ref, v_ref, tables_ref, k_smem, v_smem, k_bars, v_bars, seq=seq,
                        h=h, kb=kb, slot=slot, n_pages=n_pages)

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
        s = _scores(q_smem, k_smem.at[slot], kt_smem) * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        carry, p = _softmax_step(carry, s, mask)
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(v_bars.at[slot])

        # Only the first and last KV blocks can hold slots outside [kv_lo, kv_hi).
        @pl.when((kb * block_kv < kv_lo) | ((kb + 1) * block_kv > kv_hi))
        def _():
            _zero_dead_values(v_smem.at[slot], kb * block_kv, kv_lo, kv_hi, layout)

        acc, m, l = carry
        return acc + _values(p_smem, v_smem.at[slot], acc.shape), m, l

    head_dim = q_smem.shape[1]
    acc = layout(jnp.zeros((ROWS, head_dim), jnp.float32), WGMMA)
    plgpu.barrier_wait(sink_bar)
    m, l = softmax_start(layout(sink_smem[...], WGMMA_ROW), MASK_VALUE)
    acc, m, l = lax.fori_loop(kb_lo, kb_hi, body, (acc, m, l))

    # Rows that saw no key (empty blocks, padding rows) have acc == 0, and
    # l == 0 without a sink: write 0.
    inv_l = jnp.where(l > 0.0, 1.0 / jnp.where(l > 0.0, l, 1.0), 0.0)
    q_smem[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(q_smem.dtype)
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


def _fetch_kv_block(k_ref, v_ref, tables_ref, k_smem, v_smem, k_bars, v_bars, *, seq, h, kb,
                    slot, n_pages):
    """Start the TMA copies of KV block kb of sequence `seq`: one page copy
    per page into consecutive rows of the slot, K and V on their own
    barriers (one arrival per copy). Table entries past the sequence's
    pages are not followed: page 0 (the trash page) is read instead."""
    page_size = k_ref.shape[2]
    pages_per_block = k_smem.shape[1] // page_size
    for i in range(pages_per_block):
        idx = kb * pages_per_block + i
        page = jnp.where(idx < n_pages, tables_ref[seq, idx], 0)
        rows = pl.ds(i * page_size, page_size)
        plgpu.copy_gmem_to_smem(k_ref.at[h, page], k_smem.at[slot, rows], k_bars.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[h, page], v_smem.at[slot, rows], v_bars.at[slot])


def _scores(q_smem, k_tile, kt_smem):
    """S = Q K^T [ROWS, block_kv] float32 by wgmma, both operands in SMEM.
    On the GPU the B operand is the K tile's transposed view (wgmma reads it
    K-major). jax 0.10's interpret mode cannot read a transposed SMEM view in
    wgmma, so there (kt_smem given) the tile is transposed through registers
    into kt_smem first; the product is the same."""
    if kt_smem is None:
        rhs = plgpu.transpose_ref(k_tile, (1, 0))
    else:
        kt_smem[...] = k_tile[...].T
        plgpu.commit_smem()
        rhs = kt_smem

    def product(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, rhs)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((q_smem.shape[0], k_tile.shape[0]), jnp.float32))


def _softmax_step(carry, s, mask):
    """Fold the masked scores s [ROWS, block_kv] into the running max m and
    sum l [ROWS]; rescale acc. Returns the new carry and the block's
    probabilities p (exactly 0 where masked, also in rows that saw no key yet)."""
    acc, m, l = carry
    s = jnp.where(mask, s, MASK_VALUE)
    m_next = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_next)
    p = jnp.where(mask, jnp.exp(s - lax.broadcast_in_dim(m_next, s.shape, [0])), 0.0)
    l_next = l * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return (acc, m_next, l_next), p


def _values(p_smem, v_tile, shape):
    """P V [ROWS, D] float32 by wgmma (P and V from SMEM)."""
    def product(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_tile)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))


def _zero_dead_values(v_tile, key0, kv_lo, kv_hi, layout):
    """Zero the value rows of keys outside [kv_lo, kv_hi): unwritten slots
    (and pages behind the window) may hold anything, NaN included, and a
    masked probability of 0 times NaN would still reach the output."""
    v = v_tile[...]
    key = key0 + layout(lax.broadcasted_iota(jnp.int32, v.shape, 0), WGMMA)
    v_tile[...] = jnp.where((key >= kv_lo) & (key < kv_hi), v, jnp.zeros_like(v))
    plgpu.commit_smem()
