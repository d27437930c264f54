"""MXFP4 experts (gpt-oss checkpoints): read as float, dequantized on load.

A quantized expert tensor ``P`` (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) is stored as two tensors:

    P_blocks  [X, R, G, 16] uint8   two FP4 (e2m1) codes per byte: value 2b
                                    of a group in byte b's low nibble,
                                    value 2b + 1 in its high nibble
    P_scales  [X, R, G]     uint8   one e8m0 exponent per group of 32 values:
                                    the group times 2 ** (scale - 127)

R is the tensor's output dimension and G * 32 its input dimension, so the
dequantized [X, R, G * 32] is transposed to the [X, in, out] layout of the
float checkpoints' ``P`` (gate_up [X, E, 2Fm], down [X, Fm, E]). jaxkv's
experts run in the model dtype, so the values are dequantized once here
(every FP4 value times a power of two is exact in float32 and bfloat16)
and the loader then casts them like any other tensor; the weights take
the model dtype's bytes, not MXFP4's 4.25 bits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# The 16 FP4 e2m1 codes: sign bit 3, then exponent bits 2..1 and mantissa bit 0.
FP4_E2M1 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> float32
    [..., G * 32] (see the module docstring for the layout)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(
            f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1:] != (16,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"mxfp4: blocks {blocks.shape} do not match scales {scales.shape} "
            "(expected blocks [..., G, 16] and scales [..., G])"
        )
    values = np.empty(blocks.shape[:-1] + (32,), np.float32)
    values[..., 0::2] = FP4_E2M1[blocks & 0x0F]
    values[..., 1::2] = FP4_E2M1[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(blocks.shape[:-2] + (-1,))


def mxfp4_tensors(
    tensors: Mapping[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]],
    source: str = "checkpoint",
) -> dict[str, Any]:
    """`tensors` (name -> (shape, loader)) with every ``P_blocks`` /
    ``P_scales`` pair replaced by ``P`` [X, G * 32, R] float32, dequantized
    when loaded, expert by expert. A block tensor without its scales (or
    the reverse), or a pair that is not [X, R, G, 16] / [X, R, G], is a
    ValueError naming it."""
    out = dict(tensors)
    pairs = sorted(n[: -len("_blocks")] for n in tensors if n.endswith("_blocks"))
    for base in pairs:
        b, s = base + "_blocks", base + "_scales"
        if s not in tensors:
            raise ValueError(f"{source}: {b} has no {s}")
        (bshape, bload), (sshape, sload) = out.pop(b), out.pop(s)
        if len(bshape) != 4 or bshape[3] != 16 or tuple(bshape[:3]) != tuple(sshape):
            raise ValueError(
                f"{source}: {b} {tuple(bshape)} and {s} {tuple(sshape)} are not "
                "[X, R, G, 16] and [X, R, G]"
            )
        X, R, G = sshape
        out[base] = ((X, G * 32, R), _loader(bload, sload, (X, G * 32, R)))
    left = sorted(n for n in out if n.endswith("_scales"))  # the paired ones are gone
    if left:
        raise ValueError(f"{source}: {left[0]} has no {left[0][: -len('_scales')]}_blocks")
    if pairs:
        log.info("%s: %d MXFP4 expert tensors dequantized to float on load", source, len(pairs))
    return out


def _loader(
    blocks: Callable[[], np.ndarray], scales: Callable[[], np.ndarray], shape: tuple[int, ...]
):
    def load() -> np.ndarray:
        b, s = blocks(), scales()
        w = np.empty(shape, np.float32)
        for x in range(shape[0]):  # one expert's float copy at a time
            w[x] = dequantize_mxfp4(b[x], s[x]).T
        return w

    return load
