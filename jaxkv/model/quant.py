"""int8 weights with one float32 scale per output channel.

Two modes:
- "int8" (weight-only): the matmul computes (x @ q) * s, converting q in
  the fused dot, so only int8 bytes are read from memory on accelerators.
- "w8a8": for XLA's CPU backend, whose int8 x int8 -> int32 dots run 2-4x
  faster than float32 ones from 2 rows up (and read a quarter of the
  bytes) but are ~9x slower at exactly one row. Every step quantizes
  each activation row to int8 (after a Hadamard rotation) and uses that
  dot; a one-row step is padded to two rows. Only the int8 weights are
  kept (a quarter of the float32 bytes).

A weight w [N_in, N_out] becomes q = round(w / s) int8 with s [N_out] =
max |w[:, j]| / 127; the matmul computes (x @ q) * s, converting q in the
fused dot (so only int8 bytes are read from memory on accelerators). Why
our own and not qwix: jaxkv's weights are plain nnx.Params consumed by
explicit einsums inside a step we split and jit ourselves; weight-only
per-channel int8 is this file, whereas qwix's interception of module calls
would add a dependency and an indirection on the hot path for no gain.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.model import cpu_gemm

QUANT_MODES = (None, "int8", "w8a8")
W8A8_MIN_ROWS = 2  # a smaller step is padded up to this many rows
W8A8_BLOCK = 64  # Hadamard block of the activation rotation


def hadamard(n: int, max_block: int | None = None) -> np.ndarray:
    """An orthonormal [n, n] block-diagonal matrix of normalized Walsh-Hadamard
    blocks, each the largest power of two dividing n (at most max_block).
    Multiplying a vector by it spreads a few large channels over a whole
    block, so one absmax int8 scale per vector loses far less precision."""
    b = n & -n
    if max_block is not None:
        b = min(b, max_block)
    h = np.ones((1, 1))
    while h.shape[0] < b:
        h = np.block([[h, h], [h, -h]])
    return np.kron(np.eye(n // b), h / np.sqrt(b)).astype(np.float32)


def rotate_blocks(x, block: int):
    """x [..., N] times hadamard(N, block) along the last axis, computed
    without the zeros ([..., N/b, b] @ [b, b]); float32 out. The blocks are
    symmetric, so the same call also rotates back."""
    *lead, N = x.shape
    h = jnp.asarray(hadamard(block))
    y = jnp.einsum(
        "...nb,bc->...nc",
        x.astype(jnp.float32).reshape(*lead, N // block, block),
        h,
        precision=jax.lax.Precision.HIGHEST,
    )
    return y.reshape(*lead, N)


def quantize_weight(w):
    """w [N_in, N_out] -> (int8 [N_in, N_out], scale [N_out] float32): one
    symmetric absmax scale per output channel."""
    w = jnp.asarray(w, jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=0) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)
    return jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8), scale


class Dense(nnx.Module):
    """A [N_in, N_out] weight, full precision or int8 with per-column scales."""

    def __init__(self, w, quantize: str | None = None):
        if quantize not in QUANT_MODES:
            raise ValueError(f"quantize: must be one of {QUANT_MODES}, got {quantize!r}")
        self.mode = quantize
        if quantize == "int8":
            q, s = quantize_weight(w)
            self.w = nnx.Param(q)
            self.scale = nnx.Param(s)
        elif quantize == "w8a8":
            # Activations are rotated by R before they are quantized
            # (x @ w = (x R) (R^T w)); the int8 weight holds R^T w.
            n_in, n_out = w.shape
            b = self.block = min(n_in & -n_in, W8A8_BLOCK)
            h = jnp.asarray(hadamard(b))  # symmetric: R^T w is h @ each block of w
            wr = jnp.einsum(
                "bc,ncO->nbO",
                h,
                jnp.asarray(w, jnp.float32).reshape(n_in // b, b, n_out),
                precision=jax.lax.Precision.HIGHEST,
            )
            q, s = quantize_weight(wr.reshape(n_in, n_out))
            self.w8 = nnx.Param(q)
            self.w8_scale = nnx.Param(s)
            self.scale = None
        else:
            self.w = nnx.Param(w)
            self.scale = None

    def __call__(self, x, native: bool = False):
        """x [T, N_in] -> [T, N_out] in x's dtype. native: the caller's
        `cpu_gemm.use_native` verdict for this step (float32 weights then
        go through MKL's sgemm)."""
        if native and self.mode is None and x.dtype == self.w.dtype == jnp.float32:
            return cpu_gemm.matmul(x, self.w[...])
        if self.mode == "w8a8":
            return w8a8_matmul(x, self.w8[...], self.w8_scale[...], self.block)
        if self.scale is None:
            return jnp.einsum("TI,IO->TO", x, self.w[...])
        y = jnp.einsum(
            "TI,IO->TO", x, self.w[...].astype(x.dtype), preferred_element_type=jnp.float32
        )
        return (y * self.scale[...]).astype(x.dtype)

    @property
    def shape(self):
        return (self.w8 if self.mode == "w8a8" else self.w)[...].shape


def w8a8_matmul(x, w8, w8_scale, block: int):
    """x [T, N_in] @ the int8 weight w8 [N_in, N_out] (rows rotated by
    hadamard(N_in, block), per-column scales w8_scale [N_out]) -> [T, N_out]
    in x's dtype. Each row of x is rotated and quantized to int8 with its
    own absmax scale; the dot accumulates in int32. A one-row x is padded
    to `W8A8_MIN_ROWS` rows (XLA's CPU int8 dot is slow at one row)."""
    T = x.shape[0]
    if T < W8A8_MIN_ROWS:
        x = jnp.pad(x, ((0, W8A8_MIN_ROWS - T), (0, 0)))
    xf = rotate_blocks(x, block)
    xs = jnp.max(jnp.abs(xf), axis=1, keepdims=True) / 127.0  # [T, 1]
    xs = jnp.where(xs == 0, 1.0, xs)
    xq = jnp.round(xf / xs).astype(jnp.int8)
    y = jax.lax.dot_general(xq, w8, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return (y[:T].astype(jnp.float32) * xs[:T] * w8_scale).astype(x.dtype)
