"""Matmuls whose weight stays in a GGUF file's 32-value blocks (Q4_0, Q4_1,
Q5_0, Q8_0) on TPU and GPU: Pallas kernels that widen a tile of blocks to
float32 in VMEM or registers and feed it to the MXU / tensor cores, so an
accelerator reads 0.56-1.06 bytes per weight instead of bfloat16's 2 or
float32's 4. The CPU reads the same blocks through the native
`block_matmul` (`jaxkv/model/cpu_matmul.cc`).

Layout (`planes.py`): the blocks' bytes are regrouped once at load into
column-major planes, nothing widened: the quants [K, N] int8 (Q8_0) or
[K / 2, N] uint8 nibble pairs (byte j of a block holds values j and j + 16,
as in the file), the float16 scales (and Q4_1's float16 mins) as their raw
bits [K / 32, N] uint16, Q5_0's fifth bits as one 32-bit word [K / 32, N] per
block. Every plane keeps the file's bits, so the bytes are the file's.

Values (`planes.dequantize_tile`): the float32 values the gguf library's
dequantization gives (Q8_0 q d; Q4_0 (q - 8) d; Q4_1 q d + m; Q5_0 (q - 16)
d), every product exact in float32 and Q4_1's sum rounded once, so a float32
product differs from a float32 matmul of the dequantized weight only in the
order of its sums.

Kernels: `tpu.py` (grid over row blocks, column blocks and K blocks; a K
tile of blocks widened in VMEM, one MXU dot per tile, float32 accumulator),
`gpu.py` (Triton: one program per row block and column block, a loop over
the K blocks, two K = 16 dots per block for the nibble formats);
`reference.py` widens the whole weight in XLA (any backend; the fallback for
shapes the kernels do not tile). `matmul` picks by backend."""

from __future__ import annotations

from pallas_kernels.block_matmul.planes import FORMATS, Planes, to_planes  # noqa: F401


def matmul(x, planes: Planes, *, backend: str | None = None, interpret: bool = False):
    """x [T, K] (float32 or bfloat16) @ W^T, W the [N, K] weight in `planes`
    -> [T, N] float32, by the kernel of `backend` ("tpu", "gpu"; None:
    JAX's default backend; other backends, and shapes a kernel does not tile,
    widen the weight in XLA)."""
    import jax

    from pallas_kernels.block_matmul import gpu, reference, tpu

    backend = backend or jax.default_backend()
    if backend == "tpu" and tpu.tiles(x.shape[0], planes):
        return tpu.matmul(x, planes, interpret=interpret)
    if backend in ("gpu", "cuda", "rocm") and gpu.tiles(x.shape[0], planes):
        return gpu.matmul(x, planes, interpret=interpret)
    return reference.matmul(x, planes)
