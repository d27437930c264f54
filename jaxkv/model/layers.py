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
    keeps short ones, and interpolates the band in between smoothly; "yarn"
    likewise with a ramp over the dimensions (`yarn_frequencies`).
    `local`: the sliding layers' own base (`rope_local_theta`), unscaled."""
    D = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    rs = None if local else config.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    if rs.rope_type == "linear":  # positions interpolated: p / factor
        return (inv / rs.factor).astype(np.float32)
    if rs.rope_type == "yarn":
        return yarn_frequencies(inv, theta, D, rs).astype(np.float32)
    wavelen = 2 * np.pi / inv
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    scaled = np.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    scaled = np.where(mid, (1 - smooth) * scaled / rs.factor + smooth * scaled, scaled)
    return scaled.astype(np.float32)


def yarn_frequencies(inv: np.ndarray, theta: float, D: int, rs) -> np.ndarray:
    """YaRN's inverse frequencies [D/2] (float64) from the unscaled `inv`.
    Dimension pair i turns p * inv[i] / (2 pi) times over p positions; the
    pair that turns r times over the original context L0 is
    d(r) = D ln(L0 / (2 pi r)) / (2 ln theta). Pairs below d(beta_fast)
    (fast, many turns) keep their frequency, pairs above d(beta_slow) (slow)
    are divided by `factor`, and the ramp (i - low) / (high - low) clipped
    to [0, 1] blends the two between."""
    L0 = rs.original_max_position_embeddings
    dim = lambda turns: D * np.log(L0 / (turns * 2 * np.pi)) / (2 * np.log(theta))
    low, high = dim(rs.beta_fast), dim(rs.beta_slow)
    if rs.truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if high == low:
        high = high + 1e-3  # a step rather than a ramp, not a division by zero
    ramp = np.clip(
        (np.arange(D // 2, dtype=np.float32) - low) / (high - low), 0, 1
    )  # float32 as the reference
    return inv / rs.factor * ramp + inv * (1 - ramp)


def rope_tables(positions, inv_freq, scale: float = 1.0):
    """The rotation of positions [T] at `inv_freq` for `rotate_rope`, made
    once a step for every layer: (cos, signed sin), each [T, 1, 2, D/2]
    (cos twice; -sin for the first half, sin for the second), times `scale`
    (YaRN's attention factor)."""
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, None, :], jnp.sin(ang)[:, None, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return jnp.concatenate([cos, cos], axis=2), jnp.concatenate([-sin, sin], axis=2)


def rotate_rope(x, tables):
    """x [.., T, N, D] rotated in the half-split layout (feature j pairs with
    j + D/2): x * cos + (x's halves swapped) * signed sin, the same products
    as [x1 cos - x2 sin, x2 cos + x1 sin]. Written as a reverse of the two
    halves, not a concatenation of them: XLA's CPU loop over a
    concatenation ran ~3x slower (SmolLM2's 30 layers at 512 rows,
    35 -> 12 ms)."""
    cos, sin = tables
    x4 = x.astype(jnp.float32).reshape(*x.shape[:-1], 2, x.shape[-1] // 2)
    out = x4 * cos + x4[..., ::-1, :] * sin
    return out.reshape(x.shape).astype(x.dtype)


def apply_rope(x, positions, inv_freq, scale: float = 1.0):
    """x [.., T, N, D] rotated by positions [T] (`rotate_rope` of `rope_tables`)."""
    return rotate_rope(x, rope_tables(positions, inv_freq, scale))


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
