"""The Mosaic GPU Pallas API as `mosaic_gpu.py` uses it, across jax
versions: the plgpu module (or a clear error without it), the interpret
mode's parameters, shared memory buffers in wgmma's swizzled layout and
`plgpu.kernel`'s renamed keywords."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import mosaic_gpu_kernel as mk

SWIZZLE_BYTES = 128


def api():
    """plgpu, or a clear error when this jax has no Mosaic GPU Pallas."""
    if mk.plgpu is None:
        raise RuntimeError(
            "this jax has no jax.experimental.pallas.mosaic_gpu; the Mosaic GPU "
            "kernel needs jax >= 0.10 (use gpu.py, the Triton kernel)"
        )
    return mk.plgpu


def interpret_params(interpret):
    """The `interpret=` value for plgpu.kernel: None (compiled) or the GPU
    interpret mode's parameters. `interpret=True` alone would pick Pallas'
    generic interpreter, which knows no barriers or TMA."""
    if interpret is False or interpret is None:
        return None
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        raise RuntimeError(
            f"this jax ({jax.__version__}) has no Mosaic GPU interpret mode "
            "(jax._src.pallas.mosaic_gpu.interpret, jax >= 0.10)"
        ) from e
    if interpret is True:
        return InterpretGPUParams()
    if not isinstance(interpret, InterpretGPUParams):
        raise ValueError(f"interpret must be a bool or an InterpretGPUParams, got {interpret!r}")
    return interpret


def swizzle_bytes(width, dtype):
    """The swizzle (bytes) of a tile whose rows hold `width` elements of
    `dtype`: a row's bytes, at most 128."""
    return min(SWIZZLE_BYTES, width * jnp.dtype(dtype).itemsize)


def smem(shape, dtype, swizzle):
    """A shared memory buffer in wgmma's tiled, swizzled layout (tiles of 8
    rows of `swizzle` bytes)."""
    plgpu = api()
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(
        shape,
        dtype,
        transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)),
    )


def kernel_call(body, out_type, scratch, *, grid, grid_names, interpret, name):
    """plgpu.kernel across jax versions: the output / scratch keywords were
    renamed (out_shape / scratch_shapes -> out_type / scratch_types)."""
    plgpu = api()
    params = inspect.signature(plgpu.kernel).parameters
    out_kw = "out_type" if "out_type" in params else "out_shape"
    scratch_kw = "scratch_types" if "scratch_types" in params else "scratch_shapes"
    kw = {out_kw: out_type, scratch_kw: scratch}
    if "kernel_name" in inspect.signature(plgpu.Mesh).parameters:  # a mesh keyword
        kw["kernel_name"] = name
    return plgpu.kernel(body, grid=grid, grid_names=grid_names, interpret=interpret, **kw)
