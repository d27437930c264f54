"""The decoder's stateless pieces: rotary position embeddings, RMSNorm, the
MLP activations and soft caps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import ModelConfig


def rope_frequencies(config: ModelConfig, local: bool = False) -> np.ndarray:
    """Inverse frequencies [D/2] with the configured scaling: "linear" divides
    all of them by `factor`; "llama3" divides long wavelengths by `factor`,
    keeps short ones, and interpolates the band in between smoothly.
    `local`: the sliding layers' own base (`rope_local_theta`), unscaled."""
    D = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    rs = None if local else config.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.rope_type == "linear":  # positions interpolated: p / factor
        return (inv / rs.factor).astype(np.float32)
    wavelen = 2 * np.pi / inv
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    scaled = np.where(mid, (1 - smooth) * scaled / rs.factor + smooth * scaled, scaled)
    return scaled.astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """x [T, N, D] rotated by positions [T] in the half-split layout (the
    first D/2 features pair with the last D/2)."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x, scale, eps, offset: float = 0.0):
    """Normalize over the last axis in float32, cast back, then scale (as
    Hugging Face's Llama does). offset 1 (Gemma): multiply by (1 + scale) in
    float32, then cast."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (offset + scale.astype(jnp.float32))).astype(x.dtype)
    return xf.astype(x.dtype) * scale


def activation(name: str):
    """The MLP gate's activation by config name."""
    if name == "gelu_tanh":  # Hugging Face's gelu_pytorch_tanh
        return lambda g: jax.nn.gelu(g, approximate=True)
    return jax.nn.silu


def soft_cap(x, cap: float | None):
    """cap * tanh(x / cap); x itself without a cap."""
    return x if cap is None else cap * jnp.tanh(x / cap)
