"""The KV page formats every kernel reads, one definition for all of them.

- float ("float32" / "bfloat16" / "float16"): pages [KVH, P, page_size, D]
  hold the values; no scales.
- int8: pages int8 [KVH, P, page_size, D], k_scale / v_scale [KVH, P,
  page_size] float32: value = int8 * scale (one symmetric scale per token
  and KV head).
- int4: pages uint8 [KVH, P, page_size, D // 2], two values per byte,
  k_scale / v_scale [KVH, P, page_size] bfloat16 (half of int8's float32:
  34 bytes a token and KV head at D 64 against int8's 68). Byte j of a
  token holds channel j in its low nibble and channel j + D / 2 in its high
  nibble; value = (nibble - 7.5) * scale: 16 levels, symmetric, no zero
  (mid-rise; scale = absmax / 8 rounded up to bfloat16). Measured on
  SmolLM2 against the 15 levels of (nibble - 8) in [-7, 7]: the
  log-likelihood delta to bfloat16 KV -0.013 instead of -0.10 nats/token. Halves rather than neighbours: a
  kernel unpacks a row as two contiguous halves (two shifts and a concat,
  or two half-width products), never interleaving lanes.
- fp8 (float8_e4m3fn, float8_e5m2): pages [KVH, P, page_size, D] of that
  dtype, read as their values. Its scale is one float32 per KV head and
  layer (`jaxkv.model.kv_cache`), which the caller folds into the queries
  (q * k_scale: the same scores) and the output (out * v_scale), so the
  kernels take fp8 pages without scales.

The kernels' contract: k_scale / v_scale [KVH, P, page_size] come with int8
pages (float32) and int4 pages (bfloat16) and with nothing else; kernels
read both as float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}
INT4_OFFSET = 7.5  # value = (nibble - INT4_OFFSET) * scale


def page_format(pages) -> str:
    """ "float", "int8", "int4" or "fp8", from the pages' dtype."""
    dt = jnp.dtype(pages.dtype)
    if dt == jnp.uint8:
        return "int4"
    if dt == jnp.int8:
        return "int8"
    if dt in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
        return "fp8"
    return "float"


def scaled(pages) -> bool:
    """Whether pages of this format come with per-token scales."""
    return page_format(pages) in ("int8", "int4")


def head_dim(pages) -> int:
    """D of pages [KVH, P, page_size, D] (D // 2 bytes per token for int4)."""
    return pages.shape[-1] * (2 if page_format(pages) == "int4" else 1)


def pack_int4(nibbles):
    """nibbles [..., D] integers in [0, 15] -> uint8 [..., D // 2] (low
    nibble: the first half's channel, high nibble: the second half's)."""
    h = nibbles.shape[-1] // 2
    u = nibbles.astype(jnp.uint8)
    return u[..., :h] | (u[..., h:] << 4)


def unpack_int4(packed, dtype=jnp.float32):
    """uint8 [..., D // 2] -> [..., D] of `dtype`: nibble - 7.5, in [-7.5,
    7.5] (not yet scaled)."""
    lo = (packed & 15).astype(jnp.float32)
    hi = (packed >> 4).astype(jnp.float32)
    return (jnp.concatenate([lo, hi], axis=-1) - INT4_OFFSET).astype(dtype)


def fp8_from_bits(bits, fmt: str):
    """The float32 values of fp8 codes given as integers (any integer dtype,
    e.g. a `lax.bitcast_convert_type` of fp8 pages to uint8), by integer
    ops only: for kernels whose compiler has no fp8 conversion. `fmt`:
    "fp8_e4m3" (float8_e4m3fn: 4 exponent bits, bias 7, 3 mantissa bits) or
    "fp8_e5m2" (5, bias 15, 2). Normal codes become a float32 bit pattern
    (exponent rebiased to 127), subnormal ones m * 2^(1 - bias - mantissa
    bits). Finite codes only: e4m3fn's NaN (0x7f) and e5m2's inf / NaN read
    as large finite numbers (the cache write saturates; none is stored)."""
    e_bits, m_bits, bias = {"fp8_e4m3": (4, 3, 7), "fp8_e5m2": (5, 2, 15)}[fmt]
    x = bits.astype(jnp.int32) & 0xFF
    e = (x >> m_bits) & ((1 << e_bits) - 1)
    m = x & ((1 << m_bits) - 1)
    normal = jax.lax.bitcast_convert_type(
        ((e + 127 - bias) << 23) | (m << (23 - m_bits)), jnp.float32
    )
    sub = m.astype(jnp.float32) * (2.0 ** (1 - bias - m_bits))
    mag = jnp.where(e == 0, sub, normal)
    return jnp.where((x >> 7) == 1, -mag, mag)


def dequantize(pages, scale=None, dtype=jnp.float32):
    """Pages (any slice [..., D] or int4's [..., D // 2]) -> values [..., D] of
    `dtype`; `scale` [...] (one per token) for int8 and int4."""
    fmt = page_format(pages)
    x = unpack_int4(pages, dtype) if fmt == "int4" else pages.astype(dtype)
    if fmt in ("int8", "int4"):
        x = x * scale[..., None].astype(dtype)
    return x


def quantize_vectors(x, fmt: str):
    """x [..., D] -> (pages [..., D or D // 2], scale [...]): one symmetric
    absmax scale per vector; "int8": round(x / s) in [-127, 127], s float32;
    "int4": the nearest of the 16 levels (n - 7.5) s, s bfloat16."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=-1)
    if fmt == "int8":
        scale = jnp.where(amax == 0, 1.0, amax / 127.0)
        return jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8), scale
    # Up by 2^-7 before rounding to bfloat16 (8 significant bits): the stored
    # scale is never below absmax / 8, so the largest value keeps its level.
    scale = jnp.where(amax == 0, 1.0, amax / 8.0 * (1 + 2.0**-7)).astype(jnp.bfloat16)
    n = jnp.clip(jnp.floor(x / scale.astype(jnp.float32)[..., None]) + 8, 0, 15)
    return pack_int4(n), scale


def check_pages(k_pages, v_pages, k_scale, v_scale, D):
    """The format's shapes and scales (ValueError naming the problem)."""
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages dtypes differ: {k_pages.dtype}, {v_pages.dtype}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    fmt = page_format(k_pages)
    if head_dim(k_pages) != D:
        raise ValueError(
            f"head dim mismatch: q has D={D}, pages hold {head_dim(k_pages)}"
            + (" (int4: D // 2 bytes per token)" if fmt == "int4" else "")
        )
    if fmt in ("int8", "int4") and k_scale is None:
        raise ValueError(f"{fmt} pages need k_scale/v_scale [KVH, P, page_size]")
    if k_scale is not None:
        if fmt not in ("int8", "int4"):
            raise ValueError(
                f"k_scale/v_scale need int8 or int4 pages, got {k_pages.dtype} "
                "(fp8's per-head scales are folded into q and the output)"
            )
        want = k_pages.shape[:3]
        if k_scale.shape != want or v_scale.shape != want:
            raise ValueError(
                f"k_scale/v_scale must be [KVH, P, page_size] = {want}, got "
                f"{k_scale.shape}, {v_scale.shape}"
            )
    return fmt
