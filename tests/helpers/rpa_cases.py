"""Shared case builder and a naive numpy oracle for ragged paged attention
tests: scrambled page order, unused pages NaN, loops written independently of
the vectorized reference."""

from __future__ import annotations

import numpy as np


def make_case(
    rng,
    *,
    q_lens,
    kv_lens,
    num_heads,
    num_kv_heads,
    head_dim,
    page_size,
    pages_per_seq=None,
    extra_pages=3,
    pad_tokens=0,
    pad_seqs=0,
    dtype=np.float32,
    nan_fill=True,
):
    """Random ragged batch. Returns a dict of numpy inputs for the kernel
    signature (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)."""
    S = len(q_lens)
    assert all(q <= k for q, k in zip(q_lens, kv_lens))
    need = [-(-k // page_size) for k in kv_lens]
    if pages_per_seq is None:
        pages_per_seq = max(need + [1])
    total = sum(need) + extra_pages + 1
    perm = rng.permutation(np.arange(1, total))  # page 0 is the trash page
    k_pages = rng.standard_normal((num_kv_heads, total, page_size, head_dim)).astype(np.float32)
    v_pages = rng.standard_normal((num_kv_heads, total, page_size, head_dim)).astype(np.float32)
    block_tables = np.zeros((S + pad_seqs, pages_per_seq), np.int32)
    used = np.zeros((total, page_size), bool)
    i = 0
    for s, n in enumerate(need):
        block_tables[s, :n] = perm[i : i + n]
        for j in range(n):
            used[perm[i + j], : max(0, min(page_size, kv_lens[s] - j * page_size))] = True
        i += n
    if nan_fill:
        k_pages[:, ~used] = np.nan
        v_pages[:, ~used] = np.nan
    T = sum(q_lens) + pad_tokens
    q = rng.standard_normal((T, num_heads, head_dim)).astype(np.float32)
    cu = np.zeros(S + pad_seqs + 1, np.int32)
    cu[1 : S + 1] = np.cumsum(q_lens)
    cu[S + 1 :] = cu[S]
    kv = np.zeros(S + pad_seqs, np.int32)
    kv[:S] = kv_lens
    return dict(
        q=q.astype(dtype),
        k_pages=k_pages.astype(dtype),
        v_pages=v_pages.astype(dtype),
        kv_lens=kv,
        block_tables=block_tables,
        cu_q_lens=cu,
        num_seqs=np.int32(S),
    )


def naive_attention(
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
    k_scale=None,
    v_scale=None,
    num_sink_tokens=0,
):
    """Loop-per-query oracle in float64."""
    q = np.asarray(q, np.float64)
    kp = np.asarray(k_pages, np.float64)
    vp = np.asarray(v_pages, np.float64)
    if k_scale is not None:
        kp = kp * np.asarray(k_scale, np.float64)[..., None]
        vp = vp * np.asarray(v_scale, np.float64)[..., None]
    T, H, D = q.shape
    KVH, _, page_size, _ = kp.shape
    G = H // KVH
    out = np.zeros((T, H, D))
    for s in range(int(num_seqs)):
        kv_len = int(kv_lens[s])
        start, end = int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        q_len = end - start
        pos = np.arange(kv_len)
        keys = (
            np.stack([kp[:, block_tables[s, p // page_size], p % page_size] for p in pos], 1)
            if kv_len
            else np.zeros((KVH, 0, D))
        )
        vals = (
            np.stack([vp[:, block_tables[s, p // page_size], p % page_size] for p in pos], 1)
            if kv_len
            else np.zeros((KVH, 0, D))
        )
        for i in range(q_len):
            qpos = kv_len - q_len + i
            allowed = pos <= qpos
            if sliding_window is not None:
                allowed &= (pos > qpos - sliding_window) | (pos < num_sink_tokens)
            for h in range(H):
                kh = h // G
                sc = keys[kh, allowed] @ q[start + i, h] * sm_scale
                if soft_cap is not None:
                    sc = soft_cap * np.tanh(sc / soft_cap)
                if sc.size == 0:
                    continue
                w = np.exp(sc - sc.max())
                w /= w.sum()
                out[start + i, h] = w @ vals[kh, allowed]
    return out
