"""Mixture-of-experts benchmarks (issue 28), each against its peer in the
same run, medians of --runs runs:

    python scripts/bench/moe.py                    # gemm, model, ep: the CPU figures
    python scripts/bench/moe.py --what compile     # Qwen3-30B-A3B, 48 layers, EP 8: v5e / v6e / CUDA

- gemm: one Qwen3-MoE-like layer scaled to CPU (E 512, 64 experts, top 8,
  Fm 256, float32): `jaxkv.model.moe.moe_mlp` (grouped: each token's k
  rows through their own experts, `ragged_dot`) against the dense one-hot
  form (every token through every expert, weighted by its routing mask),
  and, where the native CPU library builds, the same grouped rows through
  `jaxkv.model.cpu_gemm.grouped_matmul` (each expert's rows one sgemm), at
  several token counts T: tokens/s and the ratios to dense.
- model: a tiny random Qwen3-MoE (transformers' own random init, saved as
  a Hugging Face folder) through jaxkv's engine against transformers
  (torch, CPU), decode and prefill as scripts/bench/generation.py measures them.
- ep: the same model on 2 virtual CPU devices (a subprocess), one device
  against expert parallel 2 and tensor parallel 2 (every expert's Fm
  split). The devices share the machine's cores, so this measures the
  collectives' and the shard_map's cost, not a speed-up.
- compile: scripts/bench/moe_compile.py for TPU v5e:2x4 and v6e:2x4 (libtpu,
  deviceless) and CUDA (lowering only), decode and mixed steps, EP 8:
  memory_analysis() per device beside the planner's bytes, and the
  collectives.

Writes JSON to scripts/results/ (or --json), with the CPU's name.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

ROOT = Path(__file__).resolve().parents[2]
LAYER = dict(E=512, X=64, k=8, Fm=256)
TOKENS = (1, 16, 512, 1024)
# The tiny random Qwen3-MoE (transformers' Qwen3MoeConfig fields).
TINY = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    moe_intermediate_size=256,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
)
log = functools.partial(print, file=sys.stderr, flush=True)


def _times(fn, runs: int) -> list[float]:
    fn()  # compile and warm
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_gemm(runs: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.model import cpu_gemm, moe
    from scripts.bench.common import _median

    E, X, k, Fm = LAYER["E"], LAYER["X"], LAYER["k"], LAYER["Fm"]
    rng = np.random.default_rng(0)
    gate_up = jnp.asarray(rng.normal(0, E**-0.5, (X, E, 2 * Fm)), jnp.float32)
    down = jnp.asarray(rng.normal(0, Fm**-0.5, (X, Fm, E)), jnp.float32)
    router = jnp.asarray(rng.normal(0, E**-0.5, (E, X)), jnp.float32)
    grouped = jax.jit(functools.partial(moe.moe_mlp, top_k=k, norm_topk_prob=True, act=jax.nn.silu))

    @jax.jit
    def dense(h, router, gate_up, down):
        """Every token through every expert, weighted by its routing mask [T, X]."""
        w, ex = moe.route(h, router, k, True)
        mask = (
            jnp.zeros((h.shape[0], X), jnp.float32).at[jnp.arange(h.shape[0])[:, None], ex].add(w)
        )
        g, u = jnp.split(jnp.einsum("TE,XEF->TXF", h, gate_up), 2, axis=-1)
        y = jnp.einsum("TXF,XFE->TXE", jax.nn.silu(g) * u, down)
        return jnp.einsum("TXE,TX->TE", y, mask)

    @jax.jit
    def native(h, router, gate_up, down):
        """The grouped rows (sorted by expert) through one sgemm per expert."""
        w, ex = moe.route(h, router, k, True)
        order = jnp.argsort(ex.reshape(-1), stable=True)
        sizes = jnp.bincount(ex.reshape(-1), length=X).astype(jnp.int32)
        g, u = jnp.split(cpu_gemm.grouped_matmul(h[order // k], gate_up, sizes), 2, axis=-1)
        y = cpu_gemm.grouped_matmul(jax.nn.silu(g) * u, down, sizes)
        y = jnp.zeros_like(y).at[order].set(y).reshape(h.shape[0], k, E)
        return jnp.einsum("TKE,TK->TE", y, w)

    fns = dict(grouped=grouped, dense=dense)
    if cpu_gemm.available():
        fns["grouped_native"] = native
    out = dict(layer=LAYER, dtype="float32", rows={})
    for T in TOKENS:
        h = jnp.asarray(rng.normal(0, 1, (T, E)), jnp.float32)
        ref = np.asarray(dense(h, router, gate_up, down))
        row = {}
        for name, fn in fns.items():
            err = float(np.abs(np.asarray(fn(h, router, gate_up, down)) - ref).max())
            times = _times(lambda: fn(h, router, gate_up, down).block_until_ready(), runs)
            row[name] = dict(
                tok_per_s=T / _median(times),
                ms=1e3 * _median(times),
                runs_s=times,
                max_abs_diff_vs_dense=err,
            )
        for name in fns:
            row[name]["ratio_vs_dense"] = row[name]["tok_per_s"] / row["dense"]["tok_per_s"]
        out["rows"][f"T{T}"] = row
        log(f"gemm T={T}: " + ", ".join(f"{n} {r['tok_per_s']:.0f} tok/s" for n, r in row.items()))
    return out


def tiny_model(folder: Path) -> Path:
    """The tiny random Qwen3-MoE as a Hugging Face folder (float32)."""
    import torch
    import transformers as tf

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        cfg = tf.Qwen3MoeConfig(**TINY)
        tf.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(folder)
    return folder


def _sizes():
    from scripts.bench.common import Sizes

    return Sizes(
        decode_batches=(1, 16),
        hf_decode_batches=(1, 16),
        decode_prompt=64,
        decode_steps=16,
        prefill_lens=(512,),
        prefill_chunked=(),
        e2e_requests=4,
        e2e_output=(4, 8),
        bandwidth_bytes=256 << 20,
    )


def bench_model(folder: Path, runs: int) -> dict:
    from scripts.bench.common import CompileMeter, _num_cores, measure_bandwidth
    from scripts.bench.peer_hf import HFBench
    from scripts.bench.peer_jaxkv import JaxkvBench
    from scripts.bench.phases import decode_phase, prefill_phase

    sizes, meter = _sizes(), CompileMeter()
    with meter.active():
        jx = JaxkvBench(str(folder), sizes, meter)
        jl = JaxkvBench(
            str(folder), sizes, meter, share=jx, max_num_batched_tokens=max(sizes.prefill_lens)
        )
        hf = HFBench(str(folder), _num_cores())
        bw = measure_bandwidth(sizes.bandwidth_bytes)
        out = dict(
            config=TINY,
            hf=hf.versions,
            warm_up=jx.warm_up,
            decode=decode_phase(jx, hf, sizes, runs, bw, log),
            prefill=prefill_phase(jx, jl, hf, sizes, runs, log),
        )
    return out


def bench_ep(folder: Path, runs: int) -> dict:
    """One device, EP 2 and TP 2 over 2 CPU devices (run in a child process)."""
    import jax

    from scripts.bench.common import CompileMeter, _median, make_prompts
    from scripts.bench.peer_jaxkv import JaxkvBench, Req

    sizes, meter = _sizes(), CompileMeter()
    modes = {"one_device": (1, False), "ep2": (2, True), "tp2": (2, False)}
    with meter.active():
        benches = {
            m: JaxkvBench(
                str(folder),
                sizes,
                meter,
                tensor_parallel_size=tp,
                engine_options=dict(enable_expert_parallel=ep, warmup=False),
            )
            for m, (tp, ep) in modes.items()
        }
        for jb in benches.values():  # compile what the timed runs use (warmup=False: only that)
            for B in sizes.decode_batches:
                jb.decode_run(
                    make_prompts(jb.stream, [sizes.decode_prompt] * B), sizes.decode_steps
                )
            jb.engine_run(
                [Req(make_prompts(jb.stream, [sizes.prefill_lens[0]])[0], 1)], sequential=True
            )
        stream = benches["one_device"].stream
        res = dict(devices=jax.device_count(), decode={}, prefill={})
        for B in sizes.decode_batches:
            prompts = make_prompts(stream, [sizes.decode_prompt] * B)
            rates = {m: [] for m in modes}
            for _ in range(runs):
                for m, jb in benches.items():
                    r = jb.decode_run(prompts, sizes.decode_steps)
                    rates[m].append(r["tokens"] / r["seconds"])
            res["decode"][f"batch{B}"] = _row(rates, _median)
            log(
                f"ep decode batch {B}: { {m: round(v, 1) for m, v in res['decode'][f'batch{B}'].items() if m in modes} }"
            )
        for n in sizes.prefill_lens[:1]:  # the default token budget's chunks
            prompt = make_prompts(stream, [n])[0]
            rates = {m: [] for m in modes}
            for _ in range(runs):
                for m, jb in benches.items():
                    rates[m].append(n / jb.engine_run([Req(prompt, 1)], sequential=True)["wall_s"])
            res["prefill"][f"tokens{n}"] = _row(rates, _median)
            log(
                f"ep prefill {n}: { {m: round(v, 1) for m, v in res['prefill'][f'tokens{n}'].items() if m in modes} }"
            )
    return res


def _row(rates: dict, median) -> dict:
    m = {k: median(v) for k, v in rates.items()}
    return dict(
        m,
        **{f"{k}_vs_one_device": v / m["one_device"] for k, v in m.items() if k != "one_device"},
        runs=rates,
    )


def run_ep_child(folder: Path, runs: int) -> dict:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
        ).strip(),
    )
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--what",
            "ep-child",
            "--folder",
            str(folder),
            "--runs",
            str(runs),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    sys.stderr.write(proc.stderr[-3000:])
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the EP child failed (rc {proc.returncode})")
    return json.loads(lines[-1])


def bench_compile(layers: int) -> dict:
    from scripts.bench import moe_compile as bmc

    env = bmc.tpu_env()
    out: dict = {}
    targets = (["v5e:2x4", "v6e:2x4"] if env else []) + ["cuda"]
    if env is None:
        log(
            f"compile: libtpu is not in {bmc.tpu_compiler()} (bash .ci/install_tpu_compiler.sh); CUDA only"
        )
    for target in targets:
        for kind in ("decode", "mixed"):
            cmd = [
                sys.executable,
                str(ROOT / "scripts" / "bench" / "moe_compile.py"),
                target,
                "--ep=8",
                f"--kind={kind}",
                f"--layers={layers}",
            ]
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                env=env if target != "cuda" else None,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                raise RuntimeError(f"{target} {kind}: rc {proc.returncode}\n{proc.stderr[-3000:]}")
            out[f"{target} {kind}"] = json.loads(lines[-1])
            log(f"compile {target} {kind}: done")
    return out


def print_tables(res: dict) -> None:
    g = 2**30
    if "compile" in res:
        print(
            "| target | step (T) | argument GiB | planned GiB (params + KV) | temp GiB | output GiB | "
            "alias GiB | peak GiB | HBM GiB | compile s |\n|---|---|---|---|---|---|---|---|---|---|"
        )
        for r in res["compile"].values():
            if r["target"] == "cuda":
                continue
            print(
                f"| {r['target']} | {r['kind']} ({r['tokens']}) | {r['argument'] / g:.3f} | "
                f"{r['planned_total'] / g:.3f} ({r['planned_params'] / g:.3f} + {r['planned_kv'] / g:.3f}) | "
                f"{r['temp'] / g:.3f} | {r['output'] / g:.3f} | {r['alias'] / g:.3f} | {r['peak'] / g:.3f} | "
                f"{r['hbm'] / g:.0f} | {r['compile_s']} |"
            )
    if "gemm" in res:
        names = list(next(iter(res["gemm"]["rows"].values())))
        print(
            "| T | "
            + " | ".join(f"{n} tok/s" for n in names)
            + " | "
            + " | ".join(f"{n} / dense" for n in names if n != "dense")
            + " |"
        )
        print("|---" * (2 * len(names)) + "|")
        for T, row in res["gemm"]["rows"].items():
            print(
                f"| {T[1:]} | "
                + " | ".join(f"{row[n]['tok_per_s']:.0f}" for n in names)
                + " | "
                + " | ".join(f"{row[n]['ratio_vs_dense']:.2f}x" for n in names if n != "dense")
                + " |"
            )
    if "model" in res:
        print("| phase | jaxkv tok/s | HF tok/s | ratio |\n|---|---|---|---|")
        for phase in ("decode", "prefill"):
            for name, e in res["model"][phase].items():
                hf = e.get("hf", {}).get("tok_per_s")
                print(
                    f"| {phase} {name} | {e['jaxkv']['tok_per_s']:.1f} | "
                    f"{hf or float('nan'):.1f} | {e.get('ratio') or float('nan'):.2f}x |"
                )
    if "ep" in res:
        print("| phase | one device tok/s | EP 2 tok/s | TP 2 tok/s |\n|---|---|---|---|")
        for phase in ("decode", "prefill"):
            for name, r in res["ep"][phase].items():
                print(
                    f"| {phase} {name} | {r['one_device']:.1f} | {r['ep2']:.1f} ({r['ep2_vs_one_device']:.2f}x) | "
                    f"{r['tp2']:.1f} ({r['tp2_vs_one_device']:.2f}x) |"
                )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench/moe.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--what",
        default="gemm,model,ep",
        help="comma-separated: gemm, model, ep, compile (default: gemm,model,ep)",
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--layers", type=int, default=48, help="compile: the model's first N layers")
    p.add_argument(
        "--folder",
        default=None,
        help="the tiny model's folder (default: $JAXKV_CACHE/bench_moe_tiny_qwen3_moe)",
    )
    p.add_argument(
        "--json", default=None, help="default: scripts/results/bench_moe_cpu_<date>.json"
    )
    a = p.parse_args(argv)
    what = set(a.what.split(","))
    if what == {"ep-child"}:
        print(json.dumps(bench_ep(Path(a.folder), a.runs)), flush=True)
        return 0
    from jaxkv.paths import cache_dir, enable_compilation_cache
    from scripts.bench.common import _cpu_name, _loadavg, _num_cores

    enable_compilation_cache()
    import jax

    res: dict = dict(
        meta=dict(
            cpu=_cpu_name(),
            cores=_num_cores(),
            jax=jax.__version__,
            runs=a.runs,
            date=datetime.date.today().isoformat(),
            loadavg_start=_loadavg(),
            command="python scripts/bench/moe.py " + " ".join(argv or sys.argv[1:]),
        )
    )
    folder = Path(a.folder) if a.folder else cache_dir() / "bench_moe_tiny_qwen3_moe"
    if "compile" in what:
        res["compile"] = bench_compile(a.layers)
    if "gemm" in what:
        res["gemm"] = bench_gemm(a.runs)
    if what & {"model", "ep"}:
        folder.mkdir(parents=True, exist_ok=True)
        tiny_model(folder)
    if "model" in what:
        res["model"] = bench_model(folder, a.runs)
    if "ep" in what:
        res["ep"] = run_ep_child(folder, a.runs)
    res["meta"]["loadavg_end"] = _loadavg()
    print_tables(res)
    name = "compile" if what == {"compile"} else "cpu"
    path = Path(
        a.json or ROOT / "scripts" / "results" / f"bench_moe_{name}_{res['meta']['date']}.json"
    )
    path.write_text(json.dumps(res, indent=1) + "\n")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
