"""The reference's decode path and the key-chunk helpers it shares with
the blocked prefill path (`reference.py`; pure jnp, same contract).

A batch of decodes (every live q_len <= 1) is one query row per sequence:
each sequence's pages are read in chunks of about `KEY_CHUNK` keys with an
online softmax, scores and outputs as multiply-and-reduce laid out
[KVH, S, ...] so nothing is transposed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.kv_formats import dequantize, head_dim
from pallas_kernels.ragged_paged_attention.masks import visible
from pallas_kernels.ragged_paged_attention.sinks import head_sinks, softmax_start

MASK_VALUE = -1e30
KEY_CHUNK = 128  # keys per online-softmax step of the decode and blocked paths


def gather_pages(k_pages, v_pages, k_scale, v_scale, pages):
    """K and V of `pages` [N, n] as float32 [KVH, N, n * page_size, D],
    dequantized (`kv_formats`)."""
    KVH, _, page_size, _ = k_pages.shape
    D = head_dim(k_pages)
    kb = dequantize(k_pages[:, pages], None if k_scale is None else k_scale[:, pages])
    vb = dequantize(v_pages[:, pages], None if v_scale is None else v_scale[:, pages])
    shape = (KVH, pages.shape[0], pages.shape[1] * page_size, D)
    return kb.reshape(shape), vb.reshape(shape)


def key_chunks(tables, page_size):
    """Key chunks of about `KEY_CHUNK` keys over block tables [N, W]: (pages
    per chunk, keys per chunk, the tables padded to whole chunks)."""
    W = tables.shape[1]
    chunk_pages = max(1, min(W, KEY_CHUNK // page_size))
    num_chunks = -(-W // chunk_pages)
    return (
        chunk_pages,
        chunk_pages * page_size,
        jnp.pad(tables, ((0, 0), (0, num_chunks * chunk_pages - W))),
    )


def fetch_chunk(k_pages, v_pages, k_scale, v_scale, tables, j, chunk_pages):
    """K and V [KVH, N, chunk, D] of key chunk j of each row of `tables`,
    and the chunk's key positions [chunk]."""
    pages = jax.lax.dynamic_slice_in_dim(tables, j * chunk_pages, chunk_pages, axis=1)
    kb, vb = gather_pages(k_pages, v_pages, k_scale, v_scale, pages)
    chunk = kb.shape[2]
    return kb, vb, j * chunk + jnp.arange(chunk)


def decode_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    num_sink_tokens,
    sinks=None,
):
    """The all-decode case (every live q_len <= 1): one query row per
    sequence. Each sequence's pages are read in chunks of about
    `KEY_CHUNK` keys with an online softmax, over only the chunks some
    sequence can see (not the padded width of the block table); scores and
    outputs are multiply-and-reduce over the chunk, laid out [KVH, S, ...]
    so nothing is transposed (about 3x faster than the blocked path with
    block_q=1 on XLA's CPU backend at 16 sequences). sinks [H] or None:
    learned sinks (`sinks.py`), the softmax's starting state. Returns
    [T, H, D] float32."""
    T, H, D = q.shape
    KVH, P, page_size, _ = k_pages.shape
    S, pages_per_seq = block_tables.shape
    G = H // KVH

    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    live = (jnp.arange(S) < num_seqs) & (q_lens > 0)
    rows = jnp.where(live, cu_q_lens[:-1], T)  # T = out of range: dropped on scatter
    qs = q[jnp.minimum(rows, T - 1)].astype(jnp.float32) * sm_scale
    qs = qs.reshape(S, KVH, G, D).transpose(1, 0, 2, 3)  # [KVH, S, G, D]
    kv_len = jnp.where(live, kv_lens, 0)

    chunk_pages, chunk, tables = key_chunks(block_tables, page_size)
    stop = (jnp.max(kv_len) + chunk - 1) // chunk  # the row is its sequence's last token
    if sliding_window is not None and not num_sink_tokens:
        # Keys before every row's window are dead; their pages may already be
        # handed back (trash page).
        first = jnp.min(jnp.where(live, kv_len - sliding_window, jnp.iinfo(jnp.int32).max))
        start = jnp.clip(first // chunk, 0, stop)
    else:
        start = 0

    def step(j, carry):
        m, l, acc = carry
        kb, vb, key_pos = fetch_chunk(
            k_pages, v_pages, k_scale, v_scale, tables, j, chunk_pages
        )  # [KVH, S, chunk, D]
        # The row is its sequence's last token, at kv_len - 1.
        key_live = visible(
            key_pos[None, :], (kv_len - 1)[:, None], sliding_window, num_sink_tokens
        )  # [S, chunk]
        vb = jnp.where(key_live[None, :, :, None], vb, 0.0)  # unwritten slots may hold NaN
        s = jnp.sum(qs[:, :, :, None, :] * kb[:, :, None, :, :], axis=-1)  # [KVH, S, G, chunk]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = key_live[None, :, None, :]
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.sum(p[..., None] * vb[:, :, None, :, :], axis=-2)
        return m_new, l, acc

    sink = jnp.broadcast_to(head_sinks(sinks, KVH, G)[:, None, :], (KVH, S, G))
    init = (*softmax_start(sink, MASK_VALUE), jnp.zeros((KVH, S, G, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(start, stop, step, init)
    o = acc / jnp.maximum(l, 1e-30)[..., None]  # [KVH, S, G, D]
    o = o.transpose(1, 0, 2, 3).reshape(S, H, D)
    out = jnp.zeros((T, H, D), jnp.float32)
    return out.at[rows].set(o, mode="drop")
