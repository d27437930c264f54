"""A weight kept as the GGUF file ships it: Q8_0 blocks (32 int8 values and
one float16 scale each), read by a native CPU matmul (`q8_gemm.cc`, an XLA
FFI custom call built on first use by `pallas_kernels.native`).

Why: a batch-1 decode step is bound by the bytes of weight it reads, and a
tied embedding is the largest of them (Gemma 3 270M: 262,144 x 640, 671 MB
as float32 against 168 MB as int8 plus 21 MB of scales). Every weight is
q * d, exact in float32, so the matmul forms the products a float32 matmul
of the dequantized weight forms and differs from it only in the order of
the sums: no quality is traded.

Where: the loader keeps a GGUF's Q8_0 tied embedding as blocks
(`EngineConfig.gguf_blocks`, on by default where this path runs: float32 on
one CPU device, MKL and a compiler present). The table gathers embedding
rows by dequantizing them (`rows`) and is the head (`head`). Elsewhere
(a TPU or GPU, a mesh) the same module dequantizes in XLA."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

BLOCK = 32  # values per Q8_0 block
BLOCK_BYTES = 2 + BLOCK  # a float16 scale, then the int8 values


class Q8Blocks:
    """A [rows, cols] weight on the host as Q8_0 blocks: q int8 [rows, cols],
    d float32 [rows, cols // 32] (weight = q * d per block along cols)."""

    def __init__(self, q: np.ndarray, d: np.ndarray):
        if q.dtype != np.int8 or q.ndim != 2 or q.shape[1] % BLOCK or d.shape != (
                q.shape[0], q.shape[1] // BLOCK):
            raise ValueError(f"Q8Blocks: q int8 [R, C] and d [R, C / {BLOCK}] expected, got "
                             f"{q.dtype}{list(q.shape)} and {list(d.shape)}")
        self.q, self.d = q, d.astype(np.float32)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, shape: tuple[int, int]) -> "Q8Blocks":
        """From a GGUF Q8_0 tensor's bytes (rows of `shape[1] // 32` blocks)."""
        rows, cols = shape
        b = np.ascontiguousarray(raw, np.uint8).reshape(rows, cols // BLOCK, BLOCK_BYTES)
        d = b[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = b[:, :, 2:].copy().view(np.int8).reshape(rows, cols)
        return cls(q, d)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes

    def dequantize(self) -> np.ndarray:
        r, c = self.q.shape
        return (self.q.reshape(r, c // BLOCK, BLOCK).astype(np.float32)
                * self.d[..., None]).reshape(r, c)


def available() -> bool:
    """Whether the native Q8_0 matmul is built and registered (once per process)."""
    from pallas_kernels import native

    return native.load("q8_gemm", Path(__file__).with_name("q8_gemm.cc"), ("q8_matmul",))


def use_native(platform: str | None, mesh) -> bool:
    """Whether a step compiled for `platform` (None: JAX's default backend)
    on `mesh` (None: one device) calls the native matmul."""
    return mesh is None and (platform or jax.default_backend()) == "cpu" and available()


def dequantize(q, d):
    """q int8 [R, C], d [R, C / 32] -> float32 [R, C] (in XLA)."""
    r, c = q.shape[-2:]
    return (q.reshape(*q.shape[:-1], c // BLOCK, BLOCK).astype(jnp.float32)
            * d[..., None]).reshape(*q.shape[:-2], r, c)


def matmul(x, q, d, native: bool):
    """x [T, C] float32 @ (q * d)^T -> [T, R] float32."""
    if native:
        out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
        return jax.ffi.ffi_call("jaxkv_q8_matmul", out)(x.astype(jnp.float32), q, d)
    return jnp.einsum("TC,RC->TR", x.astype(jnp.float32), dequantize(q, d),
                      preferred_element_type=jnp.float32)


class Q8Table(nnx.Module):
    """A [V, E] table (a tied embedding) kept as Q8_0 blocks."""

    def __init__(self, blocks: Q8Blocks):
        self.q = nnx.Param(jnp.asarray(blocks.q))
        self.d = nnx.Param(jnp.asarray(blocks.d))

    @property
    def shape(self):
        return self.q[...].shape

    def rows(self, ids, dtype):
        """The rows `ids` [T], dequantized -> [T, E] in `dtype`."""
        return dequantize(self.q[...][ids], self.d[...][ids]).astype(dtype)

    def head(self, h, native: bool):
        """h [S, E] @ table^T -> logits [S, V] float32."""
        return matmul(h, self.q[...], self.d[...], native)
