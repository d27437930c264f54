"""Prefill attention as dense causal blocks: the CPU path for steps that
carry long prompt chunks (pure jnp, part of the reference; same contract).

A step of T query rows over S sequence slots whose chunks are long (T / S
of at least `DENSE_MIN_ROWS_PER_SEQ`, the engine's lone-prompt buckets) is
served here. Each sequence that brings more than one row is cut into query
blocks of `block_q` rows; the blocks run one after another (a loop with a
dynamic trip count: only live blocks cost anything), and each walks only
its own keys, in chunks of 256-512 keys with an online softmax, from its
window's start to its newest row's position: nothing above the causal
diagonal beyond one diagonal chunk, nothing of the padded block table, and
no mask at all on the chunks wholly before its first row. One (KV head)
batched product of its G * block_q query rows against a chunk is the unit
of work, large enough for XLA's CPU GEMM to run near its matmul speed
(a fresh 4096-token prompt on a busy 2-core Xeon: 175-186 ms a layer,
1.5x torch's fused scaled_dot_product_attention in the same process, 1/16
of a whole-matrix softmax). Rows are
read from q and written to the output as contiguous slices (a block's
rows are consecutive), never gathered. Sequences with one row (decodes
riding in the same step) are left to the caller's decode path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.kv_formats import dequantize, head_dim
from pallas_kernels.ragged_paged_attention.masks import in_window, visible
from pallas_kernels.ragged_paged_attention.sinks import head_sinks, softmax_start

DENSE_MIN_ROWS_PER_SEQ = 32  # T / S from which a step takes this path
_MIN_BLOCK, _MAX_BLOCK = 32, 512
_MAX_KEY_CHUNK = 512
_MASK_VALUE = -1e30


def use_dense(num_tokens: int, num_seqs: int) -> bool:
    """Whether a step of T tokens over S sequence slots takes this path."""
    return num_tokens // max(num_seqs, 1) >= DENSE_MIN_ROWS_PER_SEQ


def dense_block(num_tokens: int, num_seqs: int) -> int:
    """Query rows per block: T / S rounded down to a power of two in [32, 512].
    Larger blocks make larger products (measured on a 2-core Xeon: a
    512-row block against 512 keys runs the tile at ~125 GFLOP/s, a
    128-row one at ~55) but waste up to one block of rows per sequence."""
    b = _MIN_BLOCK
    while b < _MAX_BLOCK and 2 * b <= num_tokens // max(num_seqs, 1):
        b *= 2
    return b


def served_rows(cu_q_lens, num_seqs, num_tokens):
    """[T] bool: the rows of live sequences with q_len > 1 (this path's)."""
    S = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(S) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    seq_of_row = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens), side="right")
    return (seq_of_row < num_seqs) & (q_lens[jnp.minimum(seq_of_row, S - 1)] > 1)


def _chunk(k_pages, v_pages, k_scale, v_scale, table, j, chunk_pages):
    """K and V [KVH, C, D] float32 of key chunk j of one sequence's block
    table [W'] (padded to whole chunks), dequantized (`kv_formats`)."""
    KVH, _, page_size, _ = k_pages.shape
    D = head_dim(k_pages)
    pages = jax.lax.dynamic_slice_in_dim(table, j * chunk_pages, chunk_pages)
    kb = dequantize(k_pages[:, pages], None if k_scale is None else k_scale[:, pages])
    vb = dequantize(v_pages[:, pages], None if v_scale is None else v_scale[:, pages])
    shape = (KVH, chunk_pages * page_size, D)
    return kb.reshape(shape), vb.reshape(shape)


def dense_prefill(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    block_q,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
    num_sink_tokens=0,
    sinks=None,
):
    """Attention of the rows of every sequence with q_len > 1, by dense
    causal blocks of `block_q` rows. q [T, H, D]; k_pages, v_pages [KVH, P,
    page_size, D]; kv_lens [S]; block_tables [S, W]; cu_q_lens [S + 1];
    num_seqs []; sinks [H] or None (learned sinks, `sinks.py`: the softmax's
    starting state) -> (out [T, H, D] float32, served [T] bool: the rows
    this path computed; every other row of out is zero)."""
    T, H, D = q.shape
    KVH, _, page_size, _ = k_pages.shape
    S, W = block_tables.shape
    G = H // KVH
    bq = block_q
    R = G * bq  # query rows of one KV head in one block

    q_lens = jnp.where(jnp.arange(S) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = jnp.where(q_lens > 1, (q_lens + bq - 1) // bq, 0)  # [S]
    block_end = jnp.cumsum(blocks)
    served = served_rows(cu_q_lens, num_seqs, T)

    # Key chunks of whole pages (at least one), by default block_q keys
    # within [256, 512]: long enough for a fast product, short enough that
    # the diagonal chunk wastes little.
    chunk_pages = max(1, min(max(bq, 256), _MAX_KEY_CHUNK) // page_size)
    chunk = chunk_pages * page_size
    num_chunk_pages = -(-W // chunk_pages) * chunk_pages
    tables = jnp.pad(block_tables, ((0, 0), (0, num_chunk_pages - W)))

    # Padded by one block so a block's slice never runs off the end (a
    # clamped dynamic slice would shift it).
    qp = jnp.pad(q.astype(jnp.float32) * sm_scale, ((0, bq), (0, 0), (0, 0)))
    sink = head_sinks(sinks, KVH, G)  # [KVH, G] -> [KVH, R], rows (row, g) as qb's
    sink = jnp.broadcast_to(sink[:, None, :], (KVH, bq, G)).reshape(KVH, R)

    def block(b, out):
        s = jnp.searchsorted(block_end, b, side="right")
        local = b - (block_end[s] - blocks[s])  # block index inside its sequence
        row0 = cu_q_lens[s] + local * bq
        kv_len = kv_lens[s]
        pos0 = kv_len - q_lens[s] + local * bq  # position of the block's first row
        last = jnp.minimum(pos0 + bq, kv_len) - 1  # the newest key any row sees
        row_pos = pos0 + jnp.arange(bq)  # [bq]
        row_pos = jnp.broadcast_to(row_pos[:, None], (bq, G)).reshape(R)  # rows (row, g)
        qb = jax.lax.dynamic_slice_in_dim(qp, row0, bq)  # [bq, H, D]
        qb = qb.reshape(bq, KVH, G, D).transpose(1, 0, 2, 3).reshape(KVH, R, D)
        table = tables[s]
        stop = last // chunk + 1
        start = 0
        if sliding_window is not None and not num_sink_tokens:
            # Chunks wholly behind the oldest row's window are dead (their
            # pages may be handed back already: the trash page).
            start = jnp.clip((pos0 - sliding_window + 1) // chunk, 0, stop)

        def step(j, carry, masked=True):
            m, l, acc = carry
            kb, vb = _chunk(k_pages, v_pages, k_scale, v_scale, table, j, chunk_pages)
            sc = jnp.einsum("krd,kcd->krc", qb, kb)  # [KVH, R, C]
            if soft_cap is not None:
                sc = soft_cap * jnp.tanh(sc / soft_cap)
            if masked:
                key_pos = j * chunk + jnp.arange(chunk)  # [C]
                mask = visible(
                    key_pos[None, :], row_pos[:, None], sliding_window, num_sink_tokens
                ) & (key_pos[None, :] < kv_len)
                # Keys the block's oldest row sees in its window (or sink tokens).
                key_live = (key_pos <= last) & in_window(
                    key_pos, pos0, sliding_window, num_sink_tokens
                )
                # Unwritten or released slots may hold NaN: 0 * NaN must not
                # reach the output through the PV product.
                vb = jnp.where(key_live[None, :, None], vb, 0.0)
                sc = jnp.where(mask[None], sc, _MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
            p = jnp.exp(sc - m_new[..., None])
            if masked:
                p = jnp.where(mask[None], p, 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + jnp.sum(p, axis=-1)
            acc = acc * alpha[..., None] + jnp.einsum("krc,kcd->krd", p, vb)
            return m_new, l, acc

        init = (*softmax_start(sink, _MASK_VALUE), jnp.zeros((KVH, R, D), jnp.float32))
        # Chunks wholly before the block's first row are seen whole by every
        # row (written keys, no window): no mask. The rest are masked.
        full = start if sliding_window is not None else jnp.clip(pos0 // chunk, start, stop)
        carry = jax.lax.fori_loop(start, full, functools.partial(step, masked=False), init)
        _, l, acc = jax.lax.fori_loop(full, stop, step, carry)
        o = acc / jnp.maximum(l, 1e-30)[..., None]  # [KVH, R, D]
        o = o.reshape(KVH, bq, G, D).transpose(1, 0, 2, 3).reshape(bq, H, D)
        # A partial last block spills into the next rows: the blocks run in
        # row order, so whichever block owns those rows writes them later.
        return jax.lax.dynamic_update_slice_in_dim(out, o, row0, axis=0)

    out = jax.lax.fori_loop(0, block_end[-1], block, jnp.zeros((T + bq, H, D), jnp.float32))
    return jnp.where(served[:, None, None], out[:T], 0.0), served
