"""GGUF 32-value blocks regrouped into column-major planes (see the
package's docstring), and the widening of a tile of them to float32 that
every path shares (the kernels' bodies and the XLA reference)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
# format -> (GGUF type number, bytes per block, planes besides q and d)
FORMATS = {
    "q4_0": (2, 18, ()),
    "q4_1": (3, 20, ("m",)),
    "q5_0": (6, 22, ("qh",)),
    "q8_0": (8, 34, ()),
}
_BY_TYPE = {t: f for f, (t, _, _) in FORMATS.items()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Planes:
    """A weight W [N, K] as planes: q [K, N] int8 (q8_0) or [K / 2, N] uint8
    (two values a byte), d (and m) [K / 32, N] uint16 float16 bits, qh
    [K / 32, N] int32 (q5_0's fifth bits, as the file's uint32); `fmt` one of FORMATS."""

    q: jax.Array
    d: jax.Array
    m: jax.Array | None = None
    qh: jax.Array | None = None
    fmt: str = dataclasses.field(default="q8_0", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight W."""
        return self.d.shape[1], self.d.shape[0] * BLOCK


def to_planes(raw: np.ndarray, qtype, rows: int, cols: int) -> Planes:
    """A GGUF tensor's blocks raw [rows, cols / 32 * bytes] (uint8) of
    `qtype` (a GGUF type number or FORMATS key) -> numpy Planes of W [rows, cols]."""
    fmt = qtype if isinstance(qtype, str) else _BY_TYPE.get(int(qtype))
    if fmt not in FORMATS:
        raise ValueError(f"block_matmul reads {', '.join(FORMATS)} blocks, not GGUF type {qtype}")
    _, nbytes, _ = FORMATS[fmt]
    nb = cols // BLOCK
    raw = np.ascontiguousarray(raw, np.uint8)
    if cols % BLOCK or raw.size != rows * nb * nbytes:
        raise ValueError(
            f"{fmt}: a [{rows}, {cols}] weight needs {rows * nb * nbytes} bytes "
            f"of blocks (cols a multiple of {BLOCK}), got {raw.size}"
        )
    b = raw.reshape(rows, nb, nbytes)
    u16 = lambda part: np.ascontiguousarray(part).view(np.uint16)[..., 0].T.copy()  # [nb, rows]
    cm = lambda part, dt: np.ascontiguousarray(part).view(dt).reshape(rows, -1).T.copy()
    d = u16(b[..., 0:2])
    if fmt == "q8_0":
        return Planes(q=cm(b[..., 2:], np.int8), d=d, fmt=fmt)
    if fmt == "q4_0":
        return Planes(q=cm(b[..., 2:], np.uint8), d=d, fmt=fmt)
    if fmt == "q4_1":
        return Planes(q=cm(b[..., 4:], np.uint8), d=d, m=u16(b[..., 2:4]), fmt=fmt)
    qh = np.ascontiguousarray(b[..., 2:6]).view(np.int32)[..., 0].T.copy()  # q5_0's bits
    return Planes(q=cm(b[..., 6:], np.uint8), d=d, qh=qh, fmt=fmt)


def half_bits_to_f32(h):
    """float16 bit patterns (any integer array) -> float32 values, by integer
    ops only (no float16 arithmetic, which some TPUs lack): normal numbers
    re-biased into float32's exponent, subnormals as mantissa x 2^-24."""
    h = h.astype(jnp.int32) & 0xFFFF
    sign, exp, man = h >> 15, (h >> 10) & 31, h & 1023
    normal = jax.lax.bitcast_convert_type(
        (sign << 31) | ((exp + 112) << 23) | (man << 13), jnp.float32
    )
    tiny = man.astype(jnp.float32) * jnp.float32(2.0**-24)
    return jnp.where(exp == 0, jnp.where(sign == 1, -tiny, tiny), normal)


def nibble_values(q, qh=None):
    """Packed bytes q [G * 16, n] (any integer type), qh [G, n] or None ->
    the quants [G, 32, n] int32: value j of a block is byte j's low nibble,
    value j + 16 its high one; qh's bit i is value i's fifth bit."""
    n = q.shape[-1]
    qi = q.astype(jnp.int32).reshape(-1, 16, n)
    vals = jnp.concatenate([qi & 15, (qi >> 4) & 15], axis=1)
    if qh is not None:
        bit = jax.lax.broadcasted_iota(jnp.int32, (1, BLOCK, 1), 1)
        vals = vals | (((qh.astype(jnp.int32)[:, None, :] >> bit) & 1) << 4)
    return vals


def dequantize_tile(fmt: str, q, d, m=None, qh=None):
    """A tile of planes (q [bk or bk / 2, n], d / m / qh [bk / 32, n]) ->
    the weight's values W^T [bk, n] float32, as the gguf library widens them."""
    scale = half_bits_to_f32(d)[:, None, :]
    n = d.shape[-1]
    if fmt == "q8_0":
        vals = q.astype(jnp.float32).reshape(-1, BLOCK, n) * scale
    elif fmt == "q4_1":
        vals = nibble_values(q).astype(jnp.float32) * scale + half_bits_to_f32(m)[:, None, :]
    else:
        offset = 8 if fmt == "q4_0" else 16
        vals = (nibble_values(q, qh if fmt == "q5_0" else None) - offset).astype(
            jnp.float32
        ) * scale
    return vals.reshape(-1, n)
