"""Ragged paged attention on CPU as a native flash-attention kernel
(`cpu_kernel.cc`, XLA FFI custom calls over MKL sgemm), for pages of every
format (`kv_formats`: float32, bfloat16, float16, int8 and int4 with their
per-token scales, fp8 e4m3 / e5m2): `dense_prefill` has the contract and
return values of `dense.dense_prefill` (rows of sequences with q_len > 1);
`ragged_paged_attention` serves every live row, prefill chunks and decodes
(q_len == 1) alike, in one call (the contract of
`reference.ragged_paged_attention` without sink tokens; learned sinks
included: each row's online softmax starts from its head's sink logit).
Pages other than float32 are dequantized in the kernel one page run at a
time into an L1 tile, so they are read at their stored size.

Why: the jnp dense path makes XLA pass over every score tile once per op;
the kernel keeps each (query block x key chunk) tile in L2 between its two
GEMMs and the online softmax. A lone fresh prompt, 9 query / 3 KV heads,
head_dim 64, on a 2-core Xeon busy with another job (medians of 5,
alternating in one process; kernel / jitted dense path at block 512 /
torch's fused scaled_dot_product_attention): 1024 tokens 24-30 / 39-56 /
23-32 ms, 4096 tokens 255-297 / 401-447 / 247-305 ms; 1.4-2x the jnp
path, on par with torch. Single-threaded it runs the causal 4096-token
layer's 19 GFLOP at ~100 GFLOP/s.

Decodes: one task per (sequence, KV head) reads the keys of its window in
place from the pages (dot products and P V updates vectorized over D, an
online softmax per chunk of keys) in the same OpenMP region as the prefill
tasks; no XLA loop over key chunks.

Shapes: q [T, H, D] (any float dtype, computed in float32); k_pages,
v_pages [KVH, P, page_size, D] (int4: [..., D // 2] uint8); k_scale,
v_scale [KVH, P, page_size] with int8 / int4 pages, else None; kv_lens [S],
block_tables [S, W], cu_q_lens [S + 1], num_seqs [] int32; sinks [H] (any
float dtype, passed as float32) or None.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.native import load, unavailable
from pallas_kernels.ragged_paged_attention.checks import check_sinks
from pallas_kernels.ragged_paged_attention.dense import served_rows
from pallas_kernels.ragged_paged_attention.kv_formats import check_pages
from pallas_kernels.ragged_paged_attention.sinks import NO_SINK

_NAME = "rpa_cpu"
_SYMBOL = "rpa_dense_prefill"
_RAGGED_SYMBOL = "rpa_ragged"


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (False where native CPU
    kernels are off or cannot be built: `native.unavailable("rpa_cpu")`)."""
    return load(_NAME, Path(__file__).with_name("cpu_kernel.cc"), (_SYMBOL, _RAGGED_SYMBOL))


# The page dtypes the kernel reads (`kv_formats`).
PAGE_DTYPES = tuple(
    jnp.dtype(d)
    for d in (
        jnp.float32,
        jnp.bfloat16,
        jnp.float16,
        jnp.int8,
        jnp.uint8,
        jnp.float8_e4m3fn,
        jnp.float8_e5m2,
    )
)


def takes(q, k_pages, k_scale=None, num_sink_tokens=0) -> bool:
    """Whether this kernel serves a call: floating queries, pages of a
    format it reads (every `kv_formats` format), no sink tokens
    (num_sink_tokens; learned `sinks` it takes), and the kernel built here."""
    del k_scale  # int8 / int4 scales it reads
    return (
        not num_sink_tokens
        and jnp.issubdtype(q.dtype, jnp.floating)
        and jnp.dtype(k_pages.dtype) in PAGE_DTYPES
        and available()
    )


def _call(
    symbol,
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
    sinks,
    k_scale,
    v_scale,
):
    T, H, D = q.shape
    check_pages(k_pages, v_pages, k_scale, v_scale, D)
    if jnp.dtype(k_pages.dtype) not in PAGE_DTYPES:
        raise ValueError(f"the native CPU kernel does not read {k_pages.dtype} pages")
    if not available():
        raise RuntimeError(f"native CPU attention unavailable: {unavailable(_NAME)}")
    check_sinks(sinks, H)
    # -inf: no sink (the kernel's plain softmax start).
    sinks = (
        jnp.full((H,), NO_SINK, jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
    )
    if k_scale is None:  # the kernel takes empty scales with unscaled formats
        k_scale = v_scale = jnp.zeros((0,), jnp.float32)
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return jax.ffi.ffi_call(f"jaxkv_{symbol}", jax.ShapeDtypeStruct((T, H, D), jnp.float32))(
        jnp.asarray(q, jnp.float32),
        k_pages,
        v_pages,
        k_scale,
        v_scale,
        i32(kv_lens),
        i32(block_tables),
        i32(cu_q_lens),
        i32(num_seqs).reshape(()),
        sinks,
        sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0),
        soft_cap=np.float32(soft_cap or 0.0),
    )


def dense_prefill(
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
):
    """Attention of the rows of every sequence with q_len > 1 (causal, GQA,
    optional sliding window, soft cap and learned sinks). Shapes as in the
    module docstring -> (out [T, H, D] float32, served [T] bool: the rows
    computed; every other row of out is zero). Requires `available()`."""
    out = _call(
        _SYMBOL,
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    cu_q_lens, num_seqs = jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray(num_seqs, jnp.int32)
    return out, served_rows(cu_q_lens, num_seqs, q.shape[0])


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
):
    """Attention of every live row (causal, GQA, optional sliding window,
    soft cap and learned sinks): sequences with q_len > 1 as in
    `dense_prefill`, and decodes (q_len == 1: the query at position
    kv_len - 1 attends keys [max(0, kv_len - sliding_window), kv_len)).
    Shapes as in the module docstring -> out [T, H, D] float32. Rows of sequences with
    q_len 0 or index >= num_seqs, decodes with kv_len 0 and padding rows
    are zero. No slot at or past kv_len, or wholly before a row's window, is
    read (they may hold NaN). Requires `available()`."""
    return _call(
        _RAGGED_SYMBOL,
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
    )
