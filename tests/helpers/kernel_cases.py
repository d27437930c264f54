"""Fixed-shape ragged batches for the kernel tests.

Every batch of one config has the same shapes (T, S, P, pages_per_seq), so a
kernel compiles once per config and each batch only runs; one batch holds
all the length edge cases at once (that is what a ragged batch is for)."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from tests.helpers.rpa_cases import make_case, naive_attention

NUM_TOKENS = 96  # T, padding rows included
NUM_SEQS = 12  # S, padding sequences included
LONG = 300  # "a few hundred" tokens of context


def length_mix(page_size, kind):
    """(q_lens, kv_lens) of a batch. 'mixed': q_len 0, decodes at kv_len 1 and
    page_size - 1 / page_size / page_size + 1, a fresh prefill, a chunk after
    cached context, a page-crossing chunk and long contexts; 'decode': only
    q_len <= 1 (the kernels' decode path)."""
    p = page_size
    if kind == "decode":
        pairs = [
            (1, 1),
            (1, p - 1),
            (1, p),
            (1, p + 1),
            (0, 9),
            (1, 2 * p + 3),
            (1, LONG),
            (1, LONG - p // 2),
        ]
    else:
        pairs = [
            (0, 7),
            (1, 1),
            (1, p - 1),
            (1, p),
            (1, p + 1),
            (5, 5),
            (5, 2 * p + 3),
            (p + 9, 2 * p + 9),
            (1, LONG),
            (17, LONG - 3),
        ]
    return [q for q, _ in pairs], [k for _, k in pairs]


def batch(seed, *, page_size, kind, num_heads, num_kv_heads, head_dim, dtype=np.float32):
    """A NaN-paged ragged batch of fixed shapes; dict of numpy kernel inputs."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = length_mix(page_size, kind)
    pages_per_seq = -(-LONG // page_size) + 1
    total_pages = NUM_SEQS * pages_per_seq + 4
    need = sum(-(-k // page_size) for k in kv_lens)
    return make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pages_per_seq=pages_per_seq,
        extra_pages=total_pages - need - 1,
        pad_tokens=NUM_TOKENS - sum(q_lens),
        pad_seqs=NUM_SEQS - len(q_lens),
        dtype=dtype,
    )


KV_FORMATS = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")


def quantize(case, seed, fmt="int8"):
    """Replaces the pages by `fmt` pages (`kv_formats`): int8 / int4 random
    integers with per-token float32 scales, whose unwritten slots are NaN
    (the integers have none), so a stray read shows; fp8 the float pages
    rounded to it (unwritten slots stay NaN)."""
    rng = np.random.default_rng(seed)
    unused = np.isnan(np.asarray(case["k_pages"], np.float32)[..., 0])  # [KVH, P, page_size]
    out = dict(case)
    for name in ("k", "v"):
        pages = np.asarray(case[f"{name}_pages"], np.float32)
        if fmt.startswith("fp8"):
            dt = jnp.float8_e4m3fn if fmt == "fp8_e4m3" else jnp.float8_e5m2
            out[f"{name}_pages"] = (pages * 4.0).astype(dt)  # unit-scale values, well inside fp8
            continue
        if fmt == "int8":
            out[f"{name}_pages"] = rng.integers(-127, 128, pages.shape).astype(np.int8)
            lo, hi = 0.005, 0.02
        else:
            half = pages.shape[-1] // 2
            nib = rng.integers(0, 16, pages.shape[:-1] + (2, half)).astype(np.uint8)
            out[f"{name}_pages"] = nib[..., 0, :] | (nib[..., 1, :] << 4)
            lo, hi = 0.08, 0.3
        scale = rng.uniform(lo, hi, unused.shape).astype(np.float32)
        scale[unused] = np.nan
        out[f"{name}_scale"] = scale if fmt == "int8" else scale.astype(jnp.bfloat16)
    return out


def page_values(pages, scale=None):
    """The values pages hold, float64, decoded in numpy from the format's
    definition (`kv_formats`), independent of the kernels' code."""
    a = np.asarray(pages)
    if a.dtype == np.uint8:  # int4: low nibble channel j, high nibble channel j + D / 2
        a = np.concatenate([(a & 15).astype(np.float64), (a >> 4).astype(np.float64)], -1) - 7.5
    a = np.asarray(a, np.float64)
    return a if scale is None else a * np.asarray(scale, np.float64)[..., None]


def oracle(case, **kw):
    """naive_attention in float64 on exactly the values the kernel sees."""
    case = dict(case)
    for name in ("k", "v"):
        case[f"{name}_pages"] = page_values(case[f"{name}_pages"], case.pop(f"{name}_scale", None))
    return naive_attention(**case, **kw)


def tolerance(dtype):
    """Elementwise (atol, rtol) for outputs of unit-scale attention: f32 is
    exact up to summation order; bf16 rounds p before the PV product and the
    output itself (2^-8 relative each)."""
    return {np.dtype(np.float32): (3e-5, 3e-5), np.dtype(jnp.bfloat16): (3e-2, 3e-2)}[
        np.dtype(dtype)
    ]


class Config(NamedTuple):
    """One compiled kernel configuration of the test grid."""

    dtype: str  # "float32" | "bfloat16" (q; pages too unless int8)
    head_dim: int
    page_size: int
    num_heads: int
    num_kv_heads: int
    sliding_window: int | None = None
    soft_cap: float | None = None
    int8: bool = False
    kv: str | None = None  # "int4", "fp8_e4m3", "fp8_e5m2" (int8: the flag above)

    @property
    def fmt(self) -> str:
        """The pages' format: "float" or one of `KV_FORMATS`."""
        return "int8" if self.int8 else (self.kv or "float")

    @property
    def id(self):
        parts = [
            self.dtype[:4] if self.dtype == "float32" else "bf16",
            f"d{self.head_dim}",
            f"p{self.page_size}",
            f"h{self.num_heads}kv{self.num_kv_heads}",
        ]
        if self.sliding_window:
            parts.append(f"win{self.sliding_window}")
        if self.soft_cap:
            parts.append(f"cap{self.soft_cap:g}")
        if self.fmt != "float":
            parts.append(self.fmt)
        return "-".join(parts)


# Small default grid: every page size, GQA ratio (1, 3, 8), head dim and dtype,
# window, cap and int8 appear at least once.
DEFAULT_CONFIGS = [
    Config("float32", 64, 8, 2, 2),
    Config("float32", 128, 16, 6, 2),
    Config("bfloat16", 128, 32, 8, 1),
    Config("bfloat16", 64, 16, 6, 2, sliding_window=24),
    Config("float32", 64, 8, 8, 1, soft_cap=2.0),
    Config("float32", 128, 32, 2, 2, sliding_window=40, soft_cap=5.0),
    Config("bfloat16", 128, 16, 6, 2, int8=True),
    Config("float32", 64, 8, 8, 1, sliding_window=24, int8=True),
]

# The other page formats (`kv_formats`): each in one config of its own.
FORMAT_CONFIGS = [
    Config("float32", 64, 8, 8, 1, sliding_window=24, kv="int4"),
    Config("bfloat16", 128, 16, 6, 2, kv="int4"),
    Config("bfloat16", 128, 16, 6, 2, kv="fp8_e4m3"),
    Config("float32", 64, 8, 2, 2, soft_cap=2.0, kv="fp8_e5m2"),
]


def sweep_configs():
    """The full product, every page format included; opt-in with -m sweep."""
    out = []
    for dtype, d, p, (h, kv), (win, cap), fmt in itertools.product(
        ("float32", "bfloat16"),
        (64, 128),
        (8, 16, 32),
        ((2, 2), (6, 2), (8, 1)),
        ((None, None), (24, None), (None, 2.0)),
        ("float", "int8", "int4", "fp8_e4m3"),
    ):
        out.append(
            Config(
                dtype,
                d,
                p,
                h,
                kv,
                win,
                cap,
                fmt == "int8",
                fmt if fmt in ("int4", "fp8_e4m3") else None,
            )
        )
    return out


def config_batches(cfg: Config, seed=0):
    """The config's (kind, case, attention kwargs) for the mixed and the decode batch."""
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else np.float32
    kw = dict(sm_scale=cfg.head_dim**-0.5, sliding_window=cfg.sliding_window, soft_cap=cfg.soft_cap)
    for i, kind in enumerate(("mixed", "decode")):
        case = batch(
            seed + i,
            page_size=cfg.page_size,
            kind=kind,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=dtype,
        )
        if cfg.fmt != "float":
            case = quantize(case, seed + 10 + i, cfg.fmt)
        yield kind, case, kw


def check_against_reference_and_oracle(run_kernel, cfg: Config, seed=0):
    """Runs `run_kernel(jnp_case, **kw)` on both batches and compares it with
    the reference (same dtype) and the float64 oracle, elementwise."""
    from pallas_kernels.ragged_paged_attention import reference

    atol, rtol = tolerance(jnp.bfloat16 if cfg.dtype == "bfloat16" else np.float32)
    for kind, case, kw in config_batches(cfg, seed):
        args = {k: jnp.asarray(v) for k, v in case.items()}
        got = np.asarray(run_kernel(args, **kw).astype(jnp.float32), np.float64)
        ref = np.asarray(
            reference.ragged_paged_attention(**args, **kw).astype(jnp.float32), np.float64
        )
        want = oracle(case, **kw)
        assert np.isfinite(got).all(), f"{kind}: non-finite output"
        T_live = int(case["cu_q_lens"][int(case["num_seqs"])])
        np.testing.assert_array_equal(got[T_live:], 0.0, err_msg=f"{kind}: padding rows")
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"{kind} vs oracle")
        np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol, err_msg=f"{kind} vs reference")
