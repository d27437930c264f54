"""The BLAS under jaxkv's native CPU kernels, per CPU: the prefill
projection matmuls and the attention kernel's GEMMs with MKL, numpy's
OpenBLAS and XLA's own dots (the native kernels off), each in its own
subprocess (the choice is made once per process: JAXKV_CPU_BLAS,
JAXKV_NATIVE_CPU=0), medians of `--runs`, GFLOP/s.

    python scripts/bench/blas.py [--rows 256,1024,4096] [--runs 7] [--json out.json]

- projections: SmolLM2-135M's 120 projection matmuls of one prefill step
  (30 layers: fused QKV 576x960, output 576x576, fused gate/up 576x3072,
  down 1536x576) chained in one jitted program, at each row count.
- attention: one layer's causal prefill attention of a lone prompt (9
  query heads, 3 KV heads, head_dim 64, 16-token pages), the native kernel
  (`cpu.dense_prefill`) or, for XLA, the jnp dense path the engine runs
  without it; counted as the causal half of 4 T^2 H D flops.

The JSON holds the CPU model and vendor, the choices made on it by
`native.blas()` (the BLAS of the native kernels) and `cpu_gemm.projections()`
(which GEMM runs the float32 projections), and every run's value.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

BACKENDS = {
    "mkl": dict(JAXKV_CPU_BLAS="mkl"),
    "openblas": dict(JAXKV_CPU_BLAS="openblas"),
    "xla": dict(JAXKV_NATIVE_CPU="0"),
}
LAYER = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (N_in, N_out) per projection
LAYERS = 30


def _measure(rows: list[int], runs: int) -> dict:
    """In the child: GFLOP/s of the projections and the attention."""
    import importlib

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.model import cpu_gemm
    from pallas_kernels import native

    native_on = cpu_gemm.available()
    cpu = importlib.import_module("pallas_kernels.ragged_paged_attention.cpu")
    dense = importlib.import_module("pallas_kernels.ragged_paged_attention.dense")
    rng = np.random.default_rng(0)
    ws = [
        jnp.asarray(rng.standard_normal((i, o), np.float32) * 0.05)
        for _ in range(LAYERS)
        for i, o in LAYER
    ]
    mm = cpu_gemm.matmul if native_on else jnp.dot

    @jax.jit
    def chain(x, ws):
        s = jnp.zeros((), jnp.float32)
        for w in ws:  # independent matmuls, each output whole (the barrier: XLA may not cut it)
            s = s + jax.lax.optimization_barrier(mm(x[:, : w.shape[0]], w))[0, 0]
        return s

    def timed(fn, *args):
        fn(*args).block_until_ready()
        out = []
        for _ in range(runs):
            t = time.perf_counter()
            fn(*args).block_until_ready()
            out.append(time.perf_counter() - t)
        return out

    res = dict(
        blas=native.blas() if native_on else "xla", native=native_on, projections={}, attention={}
    )
    for T in rows:
        x = jnp.asarray(rng.standard_normal((T, 1536), np.float32))
        flops = 2.0 * T * LAYERS * sum(i * o for i, o in LAYER)
        ts = timed(chain, x, ws)
        res["projections"][str(T)] = dict(gflops=flops / statistics.median(ts) / 1e9, runs_s=ts)
        H, K, D, ps = 9, 3, 64, 16
        P = -(-T // ps)
        args = (
            jnp.asarray(rng.standard_normal((T, H, D), np.float32)),
            jnp.asarray(rng.standard_normal((K, P, ps, D), np.float32)),
            jnp.asarray(rng.standard_normal((K, P, ps, D), np.float32)),
            jnp.array([T], jnp.int32),
            jnp.arange(P, dtype=jnp.int32)[None],
            jnp.array([0, T], jnp.int32),
            jnp.array(1, jnp.int32),
        )
        if native_on:
            fn = jax.jit(lambda *a: cpu.dense_prefill(*a, sm_scale=D**-0.5)[0])
        else:
            bq = dense.dense_block(T, 1)
            fn = jax.jit(lambda *a: dense.dense_prefill(*a, block_q=bq, sm_scale=D**-0.5)[0])
        ts = timed(fn, *args)
        res["attention"][str(T)] = dict(
            gflops=2.0 * T * T * H * D / statistics.median(ts) / 1e9, runs_s=ts
        )
    return res


def _cpu() -> dict:
    from jaxkv.model import cpu_gemm
    from pallas_kernels import native

    name = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
            break
    return dict(
        cpu=name,
        vendor=native.cpu_vendor(),
        cores=os.cpu_count(),
        platform=platform.platform(),
        auto_choice=native.blas(),
        projections_choice=cpu_gemm.projections(),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="256,1024,4096")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    rows = [int(x) for x in a.rows.split(",")]
    if a.child:
        print(json.dumps(_measure(rows, a.runs)))
        return 0
    out = dict(meta=dict(_cpu(), rows=rows, runs=a.runs), backends={})
    for name, env in BACKENDS.items():
        env = {
            k: v for k, v in os.environ.items() if k not in ("JAXKV_CPU_BLAS", "JAXKV_NATIVE_CPU")
        } | env
        r = subprocess.run(
            [sys.executable, __file__, "--child", "--rows", a.rows, "--runs", str(a.runs)],
            env=env,
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise SystemExit(f"{name}: {r.stderr[-2000:]}")
        got = json.loads(r.stdout.strip().splitlines()[-1])
        if got["blas"] != name:
            raise SystemExit(f"{name}: the child ran {got['blas']}")
        out["backends"][name] = got
    m = out["meta"]
    print(
        f"{m['cpu']} ({m['vendor']}, {m['cores']} cores); jaxkv's choice here: "
        f"{m['auto_choice']} (attention), {m['projections_choice']} (projections); "
        f"GFLOP/s, medians of {a.runs}"
    )
    print("| what | rows | " + " | ".join(BACKENDS) + " |")
    print("|---|---:|" + "---:|" * len(BACKENDS))
    for part in ("projections", "attention"):
        for T in rows:
            cells = [f"{out['backends'][b][part][str(T)]['gflops']:.0f}" for b in BACKENDS]
            print(f"| {part} | {T} | " + " | ".join(cells) + " |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
