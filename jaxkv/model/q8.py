"""A tied embedding kept as the GGUF file ships it: Q8_0 blocks (a float16
scale, then 32 int8 values), the rows gathered and dequantized in XLA, and
the head read by the native block matmul (`jaxkv.model.blocks`).

Why: a batch-1 decode step is bound by the bytes of weight it reads, and a
tied embedding used as the head is the largest of them (Gemma 3 270M:
262,144 x 640, 671 MB as float32 against 178 MB of blocks; SmolLM2: 113
against 30). Every weight is q * d, exact in float32. At up to 64 rows (a
decode step; `blocks.INT_ROWS`) the head follows the layers' choice of
path (`blocks.matmul`): by default h stays float32, and the head forms the
products a float32 matmul of the dequantized weight forms would, differing
only in the order of the sums; with `JAXKV_GGUF_ROUND_X=1` it takes the
integer path, h rounded to int8 blocks of 32 as llama.cpp rounds its
activations (batch-1 decode of SmolLM2 1.2x faster than the float path,
at a cost in quality: `blocks.round_x_default`).

Where: `EngineConfig.gguf_blocks` (by default a GGUF model on one CPU
device, float32). A step compiled for another platform or under a mesh dequantizes the head in
XLA instead (`use_native`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from jaxkv.model import blocks

BLOCK = 32  # values per Q8_0 block
BLOCK_BYTES = 2 + BLOCK  # a float16 scale, then the int8 values


class Q8Blocks:
    """A [rows, cols] table on the host as its Q8_0 bytes [rows, cols / 32 * 34]."""

    def __init__(self, raw: np.ndarray, shape: tuple[int, int]):
        rows, cols = shape
        raw = np.ascontiguousarray(raw, np.uint8)
        if cols % BLOCK or raw.size != rows * cols // BLOCK * BLOCK_BYTES:
            raise ValueError(
                f"Q8Blocks: [{rows}, {cols}] needs {rows * cols // BLOCK * BLOCK_BYTES} "
                f"bytes of Q8_0 blocks, got {raw.size}"
            )
        self.raw = raw.reshape(rows, cols // BLOCK * BLOCK_BYTES)
        self.shape = (rows, cols)

    def dequantize(self) -> np.ndarray:
        """[rows, cols] float32, by the gguf library."""
        return np.asarray(gguf_dequantize(self.raw, Q.Q8_0), np.float32).reshape(self.shape)


def use_native(platform: str | None, mesh) -> bool:
    """Whether a step compiled for `platform` (None: JAX's default backend)
    on `mesh` (None: one device) calls the native matmul."""
    return mesh is None and (platform or jax.default_backend()) == "cpu" and blocks.available()


def dequantize(raw, cols: int):
    """Q8_0 bytes raw [..., cols / 32 * 34] -> float32 [..., cols] (in XLA)."""
    b = raw.reshape(*raw.shape[:-1], cols // BLOCK, BLOCK_BYTES)
    d = jax.lax.bitcast_convert_type(b[..., :2], jnp.float16).astype(jnp.float32)
    q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    return (q * d[..., None]).reshape(*raw.shape[:-1], cols)


class Q8Table(nnx.Module):
    """A [V, E] table (a tied embedding) kept as Q8_0 blocks."""

    def __init__(self, table: Q8Blocks):
        self.raw = nnx.Param(jnp.asarray(table.raw))
        self.cols = table.shape[1]

    @property
    def shape(self):
        return (self.raw[...].shape[0], self.cols)

    def rows(self, ids, dtype):
        """The rows `ids` [T], dequantized -> [T, E] in `dtype`."""
        return dequantize(self.raw[...][ids], self.cols).astype(dtype)

    def head(self, h, native: bool):
        """h [S, E] @ table^T -> logits [S, V] float32 (natively: h rounded
        as `blocks.matmul` rounds it, `JAXKV_GGUF_ROUND_X`)."""
        if native:
            return blocks.matmul(h, self.raw[...], int(Q.Q8_0))
        return jnp.einsum(
            "SE,VE->SV",
            h.astype(jnp.float32),
            dequantize(self.raw[...], self.cols),
            preferred_element_type=jnp.float32,
        )
