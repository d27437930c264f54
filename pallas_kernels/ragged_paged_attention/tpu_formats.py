"""How the TPU kernel (`tpu_kernel.py`) reads KV pages of each format
(`kv_formats`) once they are in VMEM: pages move at their stored size and
become values here, per KV block.

- float, int8 and fp8 pages convert elementwise (`page_values`); int8's
  per-token scales are applied later, to the score / probability columns
  (`scale_row`). Mosaic converts fp8 (float8_e4m3fn, float8_e5m2) to float32
  on chips without fp8 units too (compiled deviceless for v5e and v6e).
- int4 pages (uint8 [pages, page_size, D // 2]) widen to int32 first (Mosaic
  has no 8-bit shifts), split into the low and high nibbles and join as one
  [tokens, D] operand: channel j from the low nibble, j + D / 2 from the
  high one (one lane concat, in int32). Joining before the float conversions
  keeps them and the scores' matmul at full vreg width and full MXU depth,
  where two half-width products (q[:, :D/2] . lo + q[:, D/2:] . hi) would
  convert half-empty vregs and contract D / 2 twice. Their scales are
  applied as int8's, in float32 (the wrapper converts int4's bfloat16 ones).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.ragged_paged_attention.kv_formats import INT4_OFFSET


def page_values(x, dtype):
    """Pages [pages, page_size, D] (int4: uint8 [pages, page_size, D // 2]) ->
    their values [pages * page_size, D] in `dtype`, before any per-token
    scale (int4: nibble - 7.5, exact in bfloat16)."""
    if x.dtype != jnp.uint8:
        return flatten_pages(x, dtype)
    pages, page_size, half = x.shape
    b = x.astype(jnp.int32).reshape(pages * page_size, half)
    nibbles = jnp.concatenate([b & 15, b >> 4], axis=1)  # [tokens, D]
    return (nibbles.astype(jnp.float32) - INT4_OFFSET).astype(dtype)


def flatten_pages(x, dtype):
    """[pages, page_size, D] -> [pages * page_size, D] in `dtype`. Sub-32-bit
    dtypes pack rows into sublanes, so a page that is not a whole number of
    packed tiles is merged in float32 (always tile-aligned for page_size % 8)."""
    pages, page_size, d = x.shape
    packing = 4 // x.dtype.itemsize
    if page_size % (8 * packing):
        x = x.astype(jnp.float32)
    return x.reshape(pages * page_size, d).astype(dtype)


def scale_row(scales, live):
    """[pages, page_size] per-token scales -> [1, pages * page_size] lane row,
    via a one-hot matmul (exact at HIGHEST precision) instead of a lane-merging
    reshape. Slots where `live` is False become 0 first: one NaN would spread
    along its page row through the matmul."""
    pages, page_size = scales.shape
    scales = jnp.where(live, scales, 0.0)
    n = pages * page_size
    col = lax.broadcasted_iota(jnp.int32, (page_size, n), 1)
    sel = col % page_size == lax.broadcasted_iota(jnp.int32, (page_size, n), 0)
    tiled = jnp.dot(
        scales,
        sel.astype(jnp.float32),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )  # [pages, n]: scales[j, n % ps]
    own = lax.broadcasted_iota(jnp.int32, (pages, n), 1) // page_size == lax.broadcasted_iota(
        jnp.int32, (pages, n), 0
    )
    return jnp.sum(jnp.where(own, tiled, 0.0), axis=0, keepdims=True)
