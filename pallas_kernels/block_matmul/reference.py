"""The XLA path: the whole weight widened from its planes, then one dot
(float32, highest precision). Any backend; what `matmul` runs where no
kernel tiles the shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.block_matmul.planes import Planes, dequantize_tile


def matmul(x, planes: Planes):
    """x [T, K] @ W^T -> [T, N] float32."""
    w = dequantize_tile(planes.fmt, planes.q, planes.d, planes.m, planes.qh)  # [K, N]
    return jnp.dot(
        x.astype(jnp.float32),
        w,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
