"""Prefill attention on CPU as a native flash-attention kernel
(`cpu_kernel.cc`, an XLA FFI custom call over MKL sgemm): the same
contract and return values as `dense.dense_prefill`, for float32 pages.

Why: the jnp dense path makes XLA pass over every score tile once per op;
the kernel keeps each (query block x key chunk) tile in L2 between its two
GEMMs and the online softmax. A lone fresh prompt, 9 query / 3 KV heads,
head_dim 64, on a 2-core Xeon busy with another job (medians of 5,
alternating in one process; kernel / jitted dense path at block 512 /
torch's fused scaled_dot_product_attention): 1024 tokens 24-30 / 39-56 /
23-32 ms, 4096 tokens 255-297 / 401-447 / 247-305 ms; 1.4-2x the jnp
path, on par with torch. Single-threaded it runs the causal 4096-token
layer's 19 GFLOP at ~100 GFLOP/s.

Shapes: q [T, H, D]; k_pages, v_pages [KVH, P, page_size, D] float32;
kv_lens [S], block_tables [S, W], cu_q_lens [S + 1], num_seqs [] int32.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import native

_NAME = "rpa_cpu"
_SYMBOL = "rpa_dense_prefill"


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (False where native CPU
    kernels are off or cannot be built: `native.unavailable("rpa_cpu")`)."""
    return native.load(_NAME, Path(__file__).with_name("cpu_kernel.cc"), (_SYMBOL,))


def served_rows(cu_q_lens, num_seqs, num_tokens):
    """[T] bool: the rows of live sequences with q_len > 1."""
    S = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(S) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    seq_of_row = jnp.searchsorted(cu_q_lens[1:], jnp.arange(num_tokens), side="right")
    return (seq_of_row < num_seqs) & (q_lens[jnp.minimum(seq_of_row, S - 1)] > 1)


def dense_prefill(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                  sm_scale, sliding_window=None, soft_cap=None):
    """Attention of the rows of every sequence with q_len > 1 (causal, GQA,
    optional sliding window and soft cap). q [T, H, D] (cast to float32);
    k_pages, v_pages [KVH, P, page_size, D] float32; kv_lens [S];
    block_tables [S, W]; cu_q_lens [S + 1]; num_seqs [] -> (out [T, H, D]
    float32, served [T] bool: the rows computed; every other row of out is
    zero). Requires `available()`."""
    if k_pages.dtype != jnp.float32 or v_pages.dtype != jnp.float32:
        raise ValueError(f"cpu.dense_prefill takes float32 pages, got {k_pages.dtype}/"
                         f"{v_pages.dtype} (int8 pages stay on dense.py)")
    if not available():
        raise RuntimeError(f"native CPU attention unavailable: {native.unavailable(_NAME)}")
    T, H, D = q.shape
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    cu_q_lens, num_seqs = i32(cu_q_lens), i32(num_seqs)
    out = jax.ffi.ffi_call(f"jaxkv_{_SYMBOL}", jax.ShapeDtypeStruct((T, H, D), jnp.float32))(
        jnp.asarray(q, jnp.float32), k_pages, v_pages, i32(kv_lens), i32(block_tables),
        cu_q_lens, num_seqs.reshape(()), sm_scale=np.float32(sm_scale),
        sliding_window=np.int32(sliding_window or 0), soft_cap=np.float32(soft_cap or 0.0))
    return out, served_rows(cu_q_lens, num_seqs, T)
