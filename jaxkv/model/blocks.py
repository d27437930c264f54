"""Matmul weights kept in their GGUF file's blocks, as shipped: rows of
Q4_0, Q4_1, Q5_0 or Q8_0 blocks of 32 values, or of Q4_K, Q5_K or Q6_K
super-blocks of 256, read by a native CPU matmul (`cpu_matmul.cc`, an XLA
FFI custom call built on first use by `pallas_kernels.native`) that widens
each block in registers to the values the gguf library's dequantization
gives, so the products are a float32 matmul's of the dequantized weight and
only the order of the sums differs.

Why: a decode step is bound by the bytes of weight it reads. SmolLM2's
Q4_1 layers are 20 bytes per 32 values (0.625 per value), Gemma 3's Q4_K
144 per 256 (0.5625) and Q6_K 210 per 256 (0.82), against 4 per value in
float32. Tensors of other types (Q5_1, Q2_K, Q3_K, float16), and a K-quant
tensor whose rows are not a multiple of 256 values (a GGUF file cannot hold
one; llama.cpp ships such tensors as Q5_0 or Q8_0), are dequantized to
float32 as before; the fused projections run their parts side by side
(`BlockDense`).

On TPU and GPU the 32-value types (Q4_0, Q4_1, Q5_0, Q8_0) are regrouped
into planes of the same bytes and read by the Pallas kernels of
`pallas_kernels.block_matmul`; K-quant parts are dequantized there (no
Pallas kernel reads super-blocks yet).

Where: `EngineConfig.gguf_blocks` (by default a GGUF model on one CPU
device in float32; asked for, on one device: float32 on CPU, any dtype on
TPU and GPU; the tied Q8_0 embedding is `jaxkv.model.q8`)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

# The block types the native matmul reads: (values, bytes) per block.
TYPES = {
    Q.Q4_0: (32, 18),
    Q.Q4_1: (32, 20),
    Q.Q5_0: (32, 22),
    Q.Q8_0: (32, 34),
    Q.Q4_K: (256, 144),
    Q.Q5_K: (256, 176),
    Q.Q6_K: (256, 210),
}


def readable(qtype, cols: int) -> bool:
    """Whether the native matmul reads rows of `cols` values in `qtype` blocks."""
    return qtype in TYPES and cols % TYPES[qtype][0] == 0


class BlockWeight:
    """A GGUF matmul weight [out, in] (`rows` x `cols`) as its raw blocks
    [rows, cols / block values * block bytes] of `qtype` (`TYPES`); `shape`
    is the jaxkv param's shape it stands for (checked by
    `jaxkv.model.params.check_params`)."""

    def __init__(self, raw: np.ndarray, qtype, rows: int, cols: int, shape: tuple[int, ...]):
        qtype = Q(qtype)
        values, nbytes = TYPES.get(qtype, (32, 0))
        if not readable(qtype, cols) or raw.shape != (rows, cols // values * nbytes):
            raise ValueError(
                f"BlockWeight: {qtype.name} rows of {cols} values (a multiple of "
                f"{values}) expected as [{rows}, {cols // values * nbytes}] bytes, "
                f"got {list(raw.shape)}"
            )
        self.raw = raw
        self.qtype = qtype
        self.rows = rows
        self.cols = cols
        self.shape = tuple(shape)

    def dequantize(self) -> np.ndarray:
        """[rows, cols] float32, by the gguf library."""
        return np.asarray(dequantize(self.raw, self.qtype), np.float32).reshape(
            self.rows, self.cols
        )


def available() -> bool:
    """Whether the native block matmul is built and registered (once per process)."""
    from jaxkv.model import cpu_gemm

    return cpu_gemm.available()


# Run the Pallas kernels in interpret mode (tests of the TPU / GPU path on CPU).
INTERPRET = False
PALLAS_BACKENDS = ("tpu", "gpu")


def backend() -> str:
    """The backend whose matmul reads the blocks: JAX's default (tests
    patch it to run the TPU / GPU path on CPU)."""
    return jax.default_backend()


def keep_gguf_blocks(cfg, gguf_source: bool = True) -> bool:
    """Whether an engine of `cfg` (`EngineConfig`) loads a GGUF's weights in
    their blocks (`gguf_blocks`; `gguf_source`: the model is a GGUF file or
    a known model shipped as one). Asked for (True): ValueError where no
    kernel can run them (one device; on CPU float32 and the native matmul's
    build). Left to the default (None): on where measured faster, a GGUF
    source on one CPU device in float32, with no other quantization and no
    LoRA, when the native matmul is built; off otherwise, silently."""
    if cfg.gguf_blocks is None:
        return bool(
            gguf_source
            and backend() not in PALLAS_BACKENDS
            and cfg.tensor_parallel_size == 1
            and (cfg.num_processes or 1) == 1
            and cfg.dtype == "float32"
            and cfg.quantize is None
            and not cfg.enable_lora
            and available()
        )
    if not cfg.gguf_blocks:
        return False
    cpu = backend() not in PALLAS_BACKENDS
    why = (
        "one device"
        if cfg.tensor_parallel_size != 1 or (cfg.num_processes or 1) != 1
        else "dtype float32 on CPU"
        if cpu and cfg.dtype != "float32"
        else "the native CPU matmul"
        if cpu and not available()
        else None
    )
    if why:
        raise ValueError(f"gguf_blocks: the weights kept in GGUF blocks need {why}")
    return True


# Up to this many rows Q4_0 / Q4_1 / Q8_0 matmuls take the integer path
# (`matmul`): decode steps up to batch 64. On the EPYC VM it beat the tiles
# and sgemm 1.7-1.9x at 33-64 rows (SmolLM2's 30 x 4 layer matmuls: 64 rows
# 83 against 155 ms), 1.1x and even at 96 and 128 rows, slower beyond.
INT_ROWS = 64


def round_x_default() -> bool:
    """JAXKV_GGUF_ROUND_X=1: layer matmuls take the integer path of `matmul`
    (read when a step program is traced). Off by default: rounding x to
    int8 changed SmolLM2's greedy answer to "What is the capital of
    France?" from "The capital of France is Paris." to French words without
    the answer, where the float path reads the same blocks exactly (batch-1
    decode 152 against 99 tok/s on the AMD EPYC VM; float32 weights 46)."""
    return os.environ.get("JAXKV_GGUF_ROUND_X", "0") not in ("0", "false", "no", "off", "")


def matmul(x, raw, qtype: int, round_x: bool | None = None):
    """x [T, cols] float32 @ W^T, W the blocks raw [rows, ...] -> [T, rows] float32.
    `round_x` (None: `round_x_default()`): at <= INT_ROWS rows of Q4_0 / Q4_1 /
    Q8_0, x is rounded to int8 blocks of 32 and the products are integer
    (`cpu_matmul.cc`, as llama.cpp's CPU path does: batch-1 decode of
    SmolLM2 Q4_1 1.4x); False keeps x in float32 (exact to the blocks)."""
    if round_x is None:
        round_x = round_x_default()
    round_x = round_x and x.shape[0] <= INT_ROWS
    if not available():
        from pallas_kernels import native

        raise RuntimeError(
            "GGUF blocks (gguf_blocks) need the native CPU matmul: "
            f"{native.unavailable('cpu_matmul')}"
        )
    out = jax.ShapeDtypeStruct((x.shape[0], raw.shape[0]), jnp.float32)
    return jax.ffi.ffi_call("jaxkv_block_matmul", out)(
        x.astype(jnp.float32), raw, type=np.int32(qtype), round_x=np.int32(round_x)
    )


class BlockDense(nnx.Module):
    """x [T, N_in] -> [T, sum of the parts' N_out]: the parts of a fused
    projection (q, k, v; gate, up) side by side, each a `BlockWeight` or a
    float32 [N_in, N_out] array. On CPU a block part keeps its raw blocks
    for the native matmul (kind: its GGUF type); on TPU / GPU a 32-value
    type becomes `pallas_kernels.block_matmul` planes (kind: minus its
    type) and a K-quant part is dequantized (kind 0, as a dense part)."""

    def __init__(self, parts):
        from pallas_kernels.block_matmul import FORMATS, to_planes

        pallas = backend() in PALLAS_BACKENDS
        plane_types = {t for t, _, _ in FORMATS.values()}
        self.backend = backend()
        kinds, params = [], []
        for p in parts:
            if not isinstance(p, BlockWeight):
                kinds.append(0)
                params.append(nnx.Param(jnp.asarray(p)))
            elif not pallas:
                kinds.append(int(p.qtype))
                params.append(nnx.Param(jnp.asarray(p.raw)))
            elif int(p.qtype) in plane_types:
                pl = to_planes(p.raw, int(p.qtype), p.rows, p.cols)
                kinds.append(-int(p.qtype))
                params.append(
                    nnx.List(
                        [
                            nnx.Param(jnp.asarray(a))
                            for a in (pl.q, pl.d, pl.m, pl.qh)
                            if a is not None
                        ]
                    )
                )
            else:
                kinds.append(0)
                params.append(nnx.Param(jnp.asarray(p.dequantize().T)))
        self.kinds = tuple(kinds)
        self.parts = nnx.List(params)

    def __call__(self, x, native: bool = False):
        from pallas_kernels import block_matmul
        from pallas_kernels.block_matmul.planes import FORMATS

        outs = []
        for kind, p in zip(self.kinds, self.parts):
            if kind > 0:
                outs.append(matmul(x, p[...], kind).astype(x.dtype))
            elif kind < 0:
                fmt = next(f for f, (t, _, _) in FORMATS.items() if t == -kind)
                arrays = [a[...] for a in p]
                extra = {FORMATS[fmt][2][0]: arrays[2]} if len(arrays) > 2 else {}
                planes = block_matmul.Planes(q=arrays[0], d=arrays[1], fmt=fmt, **extra)
                outs.append(
                    block_matmul.matmul(
                        x, planes, backend=self.backend, interpret=INTERPRET
                    ).astype(x.dtype)
                )
            else:
                outs.append(jnp.einsum("TI,IO->TO", x, p[...].astype(x.dtype)))
        return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
