"""Pure-jnp ragged paged attention: the specification every kernel must match,
and jaxkv's CPU path where the native kernel (`cpu.py`) does not serve.

Contract (shared by every backend)::

    ragged_paged_attention(q[T, H, D], k_pages[KVH, P, page_size, D], v_pages,
                           kv_lens[S], block_tables[S, pages_per_seq],
                           cu_q_lens[S + 1], num_seqs[], *, sm_scale,
                           sliding_window=None, soft_cap=None, sinks=None,
                           k_scale=None, v_scale=None) -> [T, H, D]

Sequence s (s < num_seqs) owns query rows cu_q_lens[s] : cu_q_lens[s + 1] and
its first kv_lens[s] cached tokens live in pages block_tables[s, :]; the cache
already holds this step's new keys and values. Query i of sequence s sits at
position kv_lens[s] - q_len + i and attends causally to positions <= its own
(and > position - sliding_window when a window is set). Query head h reads KV
head h // (H // KVH): GQA without repeating K/V. Rows outside every sequence
(padding) come back as zeros. Pages come in the formats of `kv_formats.py`:
float, int8 and int4 (k_scale / v_scale [KVH, P, page_size] float32: value =
int * scale; int4 pages are [KVH, P, page_size, D // 2] uint8), fp8 (read
as their values). sinks [H] (learned attention
sinks, gpt-oss; `sinks.py`): one logit per query head that joins each of its
rows' softmax denominator with no value, neither scaled nor soft-capped.

How it stays cheap without a kernel: queries are cut into blocks that never
span two sequences, and each block walks its sequence's pages once, in
chunks of about 128 keys with an online softmax (so memory traffic is
blocks x context, not tokens x context), over only the chunks some query
can see: not the padded width of the block table, nothing past the newest
query's position, nothing behind every row's sliding window. A batch of
decodes (every q_len <= 1) takes a one-row-per-sequence path
(`decode.py`, multiply-and-reduce); a batch with prefill chunks
takes blocks of `prefill_block(T, S)` rows, or, where the step's shape
holds long chunks (T / S >= 32: a lone prompt's buckets), dense causal
blocks one after another (`dense.py`: each block only its own keys, work
above the diagonal skipped) with the decodes of the step on the decode
path. Both are traced and `lax.cond` picks one at run time, unless the
caller says which (`all_decode`). None reads past the longest live
sequence, so the block table's width (`pages_per_seq`) may be the
engine's fixed maximum.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.checks import check_sinks
from pallas_kernels.ragged_paged_attention.cpu import ragged_paged_attention as native_attention
from pallas_kernels.ragged_paged_attention.cpu import takes as native_takes
from pallas_kernels.ragged_paged_attention.decode import (
    MASK_VALUE,
    decode_attention,
    fetch_chunk,
    key_chunks,
)
from pallas_kernels.ragged_paged_attention.dense import dense_block, dense_prefill, use_dense
from pallas_kernels.ragged_paged_attention.kv_formats import check_pages
from pallas_kernels.ragged_paged_attention.masks import in_window, visible
from pallas_kernels.ragged_paged_attention.sinks import head_sinks, softmax_start

_MIN_PREFILL_BLOCK = 16
_MAX_PREFILL_BLOCK = 128


def prefill_block(num_tokens: int, num_seqs: int) -> int:
    """Query rows per block for a step of T tokens over S sequence slots.
    Every block reads its sequence's context, so fewer, larger blocks move
    less memory; but each sequence may leave one block partly
    empty, so blocks stay near T / 2S rows: at most 16 for a step of many
    short chunks, up to 128 for one long prompt."""
    b = _MIN_PREFILL_BLOCK
    while b < _MAX_PREFILL_BLOCK and 2 * b * 2 * num_seqs <= num_tokens:
        b *= 2
    return min(b, num_tokens)


def _blocked_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    block_q,
    num_blocks,
    sm_scale,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    num_sink_tokens,
    sinks=None,
):
    """Attention over `num_blocks` query blocks of `block_q` rows, each inside
    one sequence, with an online softmax over chunks of about `decode.KEY_CHUNK`
    keys. The loop runs only over chunks some block can see (from the
    oldest in-window key to the newest query's position), not the whole
    padded block table. Each (KV head, block) pair is one matrix product of
    its G * block_q query rows against the chunk. sinks [H] or None: learned
    sinks, the softmax's starting state. Returns [T, H, D] float32."""
    T, H, D = q.shape
    KVH, P, page_size, _ = k_pages.shape
    S, pages_per_seq = block_tables.shape
    G = H // KVH
    R = G * block_q  # query rows of one KV head in one block

    seq_ids = jnp.arange(S)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    q_lens = jnp.where(seq_ids < num_seqs, q_lens, 0)
    blocks_per_seq = (q_lens + block_q - 1) // block_q  # [S]
    block_end = jnp.cumsum(blocks_per_seq)  # [S]
    block_start = block_end - blocks_per_seq

    b = jnp.arange(num_blocks)
    blk_seq = jnp.minimum(jnp.searchsorted(block_end, b, side="right"), S - 1)  # [NB]
    blk_valid = b < block_end[-1]
    blk_local = b - block_start[blk_seq]  # block index inside its sequence
    r = jnp.arange(block_q)
    row_in_seq = blk_local[:, None] * block_q + r[None, :]  # [NB, bq]
    row_valid = blk_valid[:, None] & (row_in_seq < q_lens[blk_seq][:, None])
    rows = cu_q_lens[blk_seq][:, None] + row_in_seq  # [NB, bq] token index
    rows = jnp.where(row_valid, rows, T)  # T = out of range: dropped on scatter

    kv_len = jnp.where(blk_valid, kv_lens[blk_seq], 0)  # [NB]
    q_pos = (kv_len - q_lens[blk_seq])[:, None] + row_in_seq  # [NB, bq]

    # Queries as [KVH, NB, G * bq, D], rows ordered (g, row), pre-scaled.
    qb = q[jnp.minimum(rows, T - 1)].astype(jnp.float32) * sm_scale  # [NB, bq, H, D]
    qb = qb.reshape(num_blocks, block_q, KVH, G, D).transpose(2, 0, 3, 1, 4)
    qb = qb.reshape(KVH, num_blocks, R, D)
    row_pos = jnp.broadcast_to(q_pos[:, None, :], (num_blocks, G, block_q)).reshape(num_blocks, R)

    chunk_pages, chunk, tables = key_chunks(block_tables[blk_seq], page_size)  # [NB, ...]

    newest = jnp.max(jnp.where(row_valid, q_pos, -1))  # the last key any row sees
    stop = (newest + chunk) // chunk
    if sliding_window is not None:
        # Keys before every row's window (and not a sink token) are dead for the
        # whole block; their pages may already be handed back (trash page).
        oldest = q_pos[:, 0] - sliding_window + 1  # [NB]
        first = jnp.min(jnp.where(blk_valid, oldest, newest))
        start = 0 if num_sink_tokens else jnp.clip(first // chunk, 0, stop)
    else:
        start = 0

    def step(j, carry):
        m, l, acc = carry
        kb, vb, key_pos = fetch_chunk(
            k_pages, v_pages, k_scale, v_scale, tables, j, chunk_pages
        )  # [KVH, NB, chunk, D]
        key_live = key_pos[None, :] < kv_len[:, None]  # [NB, chunk]
        # Keys the block's oldest row sees in its window (or sink tokens).
        key_live &= in_window(key_pos[None, :], q_pos[:, :1], sliding_window, num_sink_tokens)
        # Unwritten slots may hold anything (NaN included); zero them so
        # 0 * NaN never reaches the output.
        vb = jnp.where(key_live[None, :, :, None], vb, 0.0)

        s = jnp.einsum("knrd,kncd->knrc", qb, kb)  # [KVH, NB, R, chunk]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        mask = key_live[:, None, :] & visible(
            key_pos[None, None, :], row_pos[:, :, None], sliding_window, num_sink_tokens
        )
        s = jnp.where(mask[None], s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask[None], jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("knrc,kncd->knrd", p, vb)
        return m_new, l, acc

    sink = jnp.broadcast_to(
        head_sinks(sinks, KVH, G)[:, None, :, None], (KVH, num_blocks, G, block_q)
    ).reshape(KVH, num_blocks, R)
    init = (*softmax_start(sink, MASK_VALUE), jnp.zeros((KVH, num_blocks, R, D), jnp.float32))
    _, l, acc = jax.lax.fori_loop(start, stop, step, init)
    o = acc / jnp.maximum(l, 1e-30)[..., None]
    o = o.reshape(KVH, num_blocks, G, block_q, D).transpose(1, 3, 0, 2, 4)
    o = o.reshape(num_blocks * block_q, H, D)
    out = jnp.zeros((T, H, D), jnp.float32)
    return out.at[rows.reshape(-1)].set(o, mode="drop")


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "num_sink_tokens",
        "all_decode",
        "native_cpu",
    ),
)
def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
    k_scale=None,
    v_scale=None,
    num_sink_tokens=0,
    all_decode=None,
    native_cpu=False,
):
    """Reference ragged paged attention; see the module docstring for the
    contract. q [T, H, D]; k_pages, v_pages [KVH, P, page_size, D]; kv_lens [S];
    block_tables [S, pages_per_seq]; cu_q_lens [S + 1]; num_seqs [] -> [T, H, D].

    `sinks` [H] or None: learned attention sinks (gpt-oss), one logit per
    query head in every row's softmax denominator (module docstring).
    `num_sink_tokens` (with `sliding_window`), a different thing: every
    query also sees the first tokens of its sequence (StreamingLLM's sink
    tokens, for streaming eviction).
    `all_decode` (static): True traces only the decode path (every live
    q_len <= 1, the caller's promise), False only the blocked path, None
    both, picked at run time. `native_cpu` (static; the CPU "auto" backend
    sets it): the whole call runs as `cpu.py`'s native kernel where that
    takes the case (any page format, no sink tokens) and is built."""
    T, H, D = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must both be [KVH, P, page_size, D], got "
            f"{k_pages.shape} and {v_pages.shape}"
        )
    KVH = k_pages.shape[0]
    check_pages(k_pages, v_pages, k_scale, v_scale, D)
    if H % KVH:
        raise ValueError(f"num query heads {H} is not a multiple of num kv heads {KVH}")
    S = kv_lens.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != S or cu_q_lens.shape != (S + 1,):
        raise ValueError(
            f"inconsistent sequence metadata: kv_lens {kv_lens.shape}, "
            f"block_tables {block_tables.shape}, cu_q_lens {cu_q_lens.shape}"
        )
    if num_sink_tokens and sliding_window is None:
        raise ValueError("num_sink_tokens needs a sliding_window")
    check_sinks(sinks, H)
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    if native_cpu and native_takes(q, k_pages, k_scale, num_sink_tokens):
        return native_attention(
            *args,
            sm_scale=sm_scale,
            soft_cap=soft_cap,
            sliding_window=sliding_window,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
        ).astype(q.dtype)
    kw = dict(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        num_sink_tokens=num_sink_tokens,
        sinks=sinks,
    )

    def decode(args):
        return decode_attention(*args, **kw)

    def prefill(args):
        if use_dense(T, S):  # long chunks: dense causal blocks, decodes apart
            out, served = dense_prefill(*args, block_q=dense_block(T, S), **kw)
            q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
            dec = decode_attention(
                q,
                k_pages,
                v_pages,
                jnp.where(q_lens == 1, kv_lens, 0),
                block_tables,
                cu_q_lens,
                num_seqs,
                **kw,
            )
            return jnp.where(served[:, None, None], out, dec)
        bq = prefill_block(T, S)
        # sum_s ceil(q_s / bq) <= (T + S (bq - 1)) / bq when sum_s q_s <= T
        return _blocked_attention(*args, block_q=bq, num_blocks=(T + S * (bq - 1)) // bq, **kw)

    if all_decode is None:
        q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
        live = jnp.arange(S) < num_seqs
        out = jax.lax.cond(jnp.all(jnp.where(live, q_lens, 0) <= 1), decode, prefill, args)
    else:
        out = decode(args) if all_decode else prefill(args)
    return out.astype(q.dtype)
