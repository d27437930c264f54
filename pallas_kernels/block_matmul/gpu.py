"""The GPU kernel (Pallas on Triton): one program per block of `bt` rows and
`bn` columns, a loop over the K blocks of 32 values. Each iteration loads a
block row of every plane ([16 or 32, bn] quants, [1, bn] scale bits),
widens it in registers (`planes.dequantize_tile`'s ops) and adds its dots to
a float32 accumulator: one K = 32 dot for q8_0, two K = 16 dots (the low
and the high nibbles, against x's two 16-column halves of the block) for
the nibble formats, so no register tile is reshaped. float32 x dots at
highest precision (IEEE, not TF32); bfloat16 x dots bfloat16 tiles.

Triton wants power-of-two tiles: bn is the largest of 128 / 64 / 32 / 16
dividing N (else the XLA path), bt 16 to 64 rows (T padded)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.block_matmul.planes import BLOCK, Planes, half_bits_to_f32


def _block_sizes(t: int, n: int) -> tuple[int, int | None]:
    bt = 16 if t <= 16 else 32 if t <= 32 else 64
    return bt, next((b for b in (128, 64, 32, 16) if n % b == 0), None)


def tiles(t: int, planes: Planes) -> bool:
    """Whether the kernel tiles a [t, K] @ W^T product."""
    return _block_sizes(t, planes.shape[0])[1] is not None


def _dot(a, b):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b.astype(a.dtype), precision=precision, preferred_element_type=jnp.float32)


def _kernel(x_ref, q_ref, d_ref, *rest, fmt: str, extra: str | None, bt: int, bn: int):
    extra_ref, (o_ref,) = (rest[0], rest[1:]) if extra else (None, rest)
    rows, cols = pl.ds(pl.program_id(0) * bt, bt), pl.ds(pl.program_id(1) * bn, bn)
    num_blocks = d_ref.shape[0]

    def body(g, acc):
        scale = half_bits_to_f32(plgpu.load(d_ref.at[pl.ds(g, 1), cols]))  # [1, bn]
        if fmt == "q8_0":
            w = plgpu.load(q_ref.at[pl.ds(g * BLOCK, BLOCK), cols]).astype(jnp.float32) * scale
            return acc + _dot(plgpu.load(x_ref.at[rows, pl.ds(g * BLOCK, BLOCK)]), w)
        packed = plgpu.load(q_ref.at[pl.ds(g * 16, 16), cols]).astype(jnp.int32)  # [16, bn]
        halves = [packed & 15, (packed >> 4) & 15]  # values j and j + 16 of the block
        if fmt == "q5_0":
            qh = plgpu.load(extra_ref.at[pl.ds(g, 1), cols]).astype(jnp.int32)  # [1, bn]
            bit = lax.broadcasted_iota(jnp.int32, (16, 1), 0)
            halves = [h | (((qh >> (bit + 16 * i)) & 1) << 4) for i, h in enumerate(halves)]
        if fmt == "q4_1":
            mins = half_bits_to_f32(plgpu.load(extra_ref.at[pl.ds(g, 1), cols]))
            ws = [h.astype(jnp.float32) * scale + mins for h in halves]
        else:
            offset = 8 if fmt == "q4_0" else 16
            ws = [(h - offset).astype(jnp.float32) * scale for h in halves]
        for i, w in enumerate(ws):
            acc = acc + _dot(plgpu.load(x_ref.at[rows, pl.ds(g * BLOCK + 16 * i, 16)]), w)
        return acc

    acc = lax.fori_loop(0, num_blocks, body, jnp.zeros((bt, bn), jnp.float32))
    plgpu.store(o_ref.at[rows, cols], acc)


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps", "num_stages"))
def matmul(x, planes: Planes, *, interpret: bool = False, num_warps: int = 4, num_stages: int = 2):
    """x [T, K] float32 / bfloat16 @ W^T -> [T, N] float32."""
    t = x.shape[0]
    n, k = planes.shape
    bt, bn = _block_sizes(t, n)
    t_pad = -(-t // bt) * bt
    xp = jnp.pad(x, ((0, t_pad - t), (0, 0))) if t_pad != t else x
    extra = "m" if planes.m is not None else "qh" if planes.qh is not None else None
    operands = [xp, planes.q, planes.d] + ([getattr(planes, extra)] if extra else [])
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    out = pl.pallas_call(
        functools.partial(_kernel, fmt=planes.fmt, extra=extra, bt=bt, bn=bn),
        grid=(t_pad // bt, n // bn),
        in_specs=[whole(a) for a in operands],
        out_specs=pl.BlockSpec((t_pad, n), lambda *_: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((t_pad, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"jaxkv_block_matmul_{planes.fmt}",
    )(*operands)
    return out[:t]
