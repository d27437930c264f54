"""Large float32 matmuls on CPU through the BLAS's sgemm (an XLA FFI custom call
of `cpu_matmul.cc`, the one library of jaxkv's CPU matmuls, built on first
use by `pallas_kernels.native`).

Why: a prefill step is matmuls, and XLA's CPU GEMM (YNNPACK) runs the
model's projections slower than MKL, the BLAS torch calls. A chain of
SmolLM2's 120 projection matmuls (30 layers, fused QKV and gate/up) on a
2-core Xeon, medians of 7, GFLOP/s:

| rows | XLA | MKL sgemm custom call |
|---:|---:|---:|
| 256 | 147 | 165 |
| 1024 | 149 | 199 |
| 4096 | 145 | 188 |

That table is Intel's. On other CPUs (an AMD EPYC VM, `scripts/bench/blas.py`)
XLA's dots lead both BLAS libraries on the projections (163 / 169 GFLOP/s at
256 / 1024 rows against OpenBLAS's 125 / 155 and MKL's 116 / 143), so
`projections()` picks per CPU at run time: "blas" (this custom call) on
Intel, "xla" elsewhere; JAXKV_CPU_PROJECTIONS=blas or =xla overrides it.
In the engine there (SmolLM2 float32 prefill, medians of 3 after a warm
run, two A/B rounds) "xla" took 256 tokens from 471-528 to 661-684 tok/s
and 1024 from 345-377 to 608-686. GGUF blocks keep their native matmul at
every row count: widening each weight for XLA's dot measured slower there
(256 tokens 402-478 against 509-526 tok/s).

Used only where it pays and is safe: projections() is "blas", the step is
compiled for the CPU (not lowered for a TPU or GPU), the model runs on one device (a custom call
has no sharding rule for GSPMD to split), weights and activations are
float32, and the step has at least `MIN_ROWS` rows (smaller steps keep
XLA's dots: at 1-16 rows both read the weights at the same speed). Otherwise, or where MKL or a
compiler is missing (`pallas_kernels.native`), XLA's dot runs.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

MIN_ROWS = 64


def available() -> bool:
    """Whether the CPU matmul library (sgemm, and the GGUF block matmul of
    `jaxkv.model.blocks`) is built and registered (once per process)."""
    from pallas_kernels import native

    return native.load(
        "cpu_matmul",
        Path(__file__).with_name("cpu_matmul.cc"),
        ("sgemm", "block_matmul", "grouped_sgemm"),
    )


def projections() -> str:
    """Which GEMM runs a CPU step's large float32 projections: "blas" (the
    sgemm custom call) or "xla" (XLA's own dot): JAXKV_CPU_PROJECTIONS, else
    "blas" on Intel CPUs and "xla" on others (read when a step is traced)."""
    import os

    from pallas_kernels import native

    want = os.environ.get("JAXKV_CPU_PROJECTIONS", "auto").lower()
    if want not in ("auto", "blas", "xla"):
        raise ValueError(f"JAXKV_CPU_PROJECTIONS: expected auto, blas or xla, got {want!r}")
    if want == "auto":
        return "blas" if native.cpu_vendor() == "GenuineIntel" else "xla"
    return want


def use_native(num_rows: int, platform: str | None, mesh) -> bool:
    """Whether a step of `num_rows` rows, compiled for `platform` (None:
    JAX's default backend) on `mesh` (None: one device), takes this path."""
    return (
        num_rows >= MIN_ROWS
        and mesh is None
        and (platform or jax.default_backend()) == "cpu"
        and projections() == "blas"
        and available()
    )


def use_native_grouped(platform: str | None) -> bool:
    """Whether the experts' grouped matmuls of a step compiled for
    `platform` take `grouped_matmul`: at any row count (a group is one
    sgemm, where XLA's CPU ragged dot runs every group on every row) and
    under shard_map (each device calls it on its own shard)."""
    return (platform or jax.default_backend()) == "cpu" and available()


def matmul(x, w):
    """x [T, N_in] float32 @ w [N_in, N_out] float32 -> [T, N_out] float32."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.ndim != 2 or w.ndim != 2:
        raise ValueError(
            f"cpu_gemm.matmul takes float32 [T, N_in] @ [N_in, N_out], got "
            f"{x.dtype}{list(x.shape)} @ {w.dtype}{list(w.shape)}"
        )
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("jaxkv_sgemm", out)(x, w)


def grouped_matmul(x, w, sizes):
    """x [M, K] float32 rows sorted by group @ w [G, K, N] float32, group g
    its next sizes[g] rows -> [M, N] float32, rows past the groups zero:
    `jax.lax.ragged_dot`'s result, each group one sgemm (XLA's CPU lowering
    multiplies every row by every group's weights and masks)."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.ndim != 2 or w.ndim != 3:
        raise ValueError(
            f"cpu_gemm.grouped_matmul takes float32 [M, K] @ [G, K, N], got "
            f"{x.dtype}{list(x.shape)} @ {w.dtype}{list(w.shape)}"
        )
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32)
    return jax.ffi.ffi_call("jaxkv_grouped_sgemm", out)(x, w, sizes.astype(jnp.int32))
