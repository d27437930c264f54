"""The TPU kernel: grid (row blocks, column blocks, K blocks), K innermost.
Each step DMAs a tile of x [bt, bk] and the planes of W^T's tile [bk, bn]
into VMEM, widens the tile to float32 (`planes.dequantize_tile`: integer
ops, then a multiply by the scale broadcast over a block's 32 sublanes) and
adds one MXU dot to a float32 accumulator in VMEM; the last K step writes
the output tile. float32 x dots at highest precision (the products a
float32 matmul of the widened weight forms); bfloat16 x dots the widened
tile rounded to bfloat16.

Tiles obey Mosaic's layout: bn 256 or 128 columns where N allows, else all
of N; bk 512 values (the nibble planes' 256 byte rows and the scales' 16
rows fill packed uint8 / uint16 tiles), else all of K; bt up to 256 rows
(T is padded to a multiple)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.block_matmul.planes import BLOCK, Planes, dequantize_tile

MAX_ROWS = 256


def _block_sizes(t: int, n: int, k: int) -> tuple[int, int, int]:
    bn = next((b for b in (256, 128) if n % b == 0), n)
    bk = 512 if k % 512 == 0 else k
    bt = min(MAX_ROWS, -(-t // 16) * 16)
    return bt, bn, bk


def tiles(t: int, planes: Planes) -> bool:
    """Whether the kernel tiles a [t, K] @ W^T product (VMEM bounds the
    untiled sides: N or K taken whole when not a multiple of 128 / 512)."""
    n, k = planes.shape
    _, bn, bk = _block_sizes(t, n, k)
    return bn * bk <= 1 << 20


def _kernel(x_ref, q_ref, d_ref, *rest, fmt: str, extra: str | None, nk: int):
    extra_ref, (o_ref, acc_ref) = (rest[0], rest[1:]) if extra else (None, rest)
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    planes = {extra: extra_ref[...]} if extra else {}
    w = dequantize_tile(fmt, q_ref[...], d_ref[...], **planes)  # [bk, bn] float32
    x = x_ref[...]
    if x.dtype == jnp.float32:
        acc_ref[...] += jnp.dot(
            x, w, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
    else:
        acc_ref[...] += jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)

    @pl.when(kk == nk - 1)
    def _():
        o_ref[...] = acc_ref[...]


@functools.partial(jax.jit, static_argnames=("interpret",))
def matmul(x, planes: Planes, *, interpret: bool = False):
    """x [T, K] float32 / bfloat16 @ W^T -> [T, N] float32."""
    t = x.shape[0]
    n, k = planes.shape
    bt, bn, bk = _block_sizes(t, n, k)
    t_pad = -(-t // bt) * bt
    xp = jnp.pad(x, ((0, t_pad - t), (0, 0))) if t_pad != t else x
    extra = "m" if planes.m is not None else "qh" if planes.qh is not None else None
    q_rows = bk if planes.fmt == "q8_0" else bk // 2
    g = bk // BLOCK
    in_specs = [
        pl.BlockSpec((bt, bk), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((q_rows, bn), lambda i, j, kk: (kk, j)),
        pl.BlockSpec((g, bn), lambda i, j, kk: (kk, j)),
    ]
    operands = [xp, planes.q, planes.d]
    if extra:
        in_specs.append(pl.BlockSpec((g, bn), lambda i, j, kk: (kk, j)))
        operands.append(getattr(planes, extra))
    out = pl.pallas_call(
        functools.partial(_kernel, fmt=planes.fmt, extra=extra, nk=k // bk),
        grid=(t_pad // bt, n // bn, k // bk),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bt, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((t_pad, n), jnp.float32),
        scratch_shapes=[pltpu.VMEM((bt, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name=f"jaxkv_block_matmul_{planes.fmt}",
    )(*operands)
    return out[:t]
