"""Tensor-parallel scaling: the same engine at tensor_parallel_size 1 and N
side by side in one run (the peer of a sharded engine is the unsharded
one), on the default model or any other.

    python scripts/bench/sharded.py --tp 8                  # a host with 8 chips
    python scripts/bench/sharded.py --tp 3 --cpu-devices 3  # CPU: 3 virtual devices

Figures: decode tok/s at each batch size and prefill tok/s at each prompt
length (the phases and workloads of scripts/bench/generation.py, its `--quick` sizes
unless --full), each the median of --runs runs, the two engines
alternating; ratio = TP N / TP 1. On CPU the virtual devices share the
machine's cores, so the ratio there measures the cost of the collectives
and the per-shard launch, not a speed-up: the figures that count come
from a TPU slice or a multi-GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench/sharded.py", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, required=True, help="tensor_parallel_size to compare with 1")
    p.add_argument("--model", default=None, help="model name or path (default: the default model)")
    p.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        help="give this process N virtual CPU devices (XLA_FLAGS, before jax starts)",
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--full", action="store_true", help="scripts/bench/generation.py's full sizes")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    if a.cpu_devices:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
            f"device_count={a.cpu_devices}"
        ).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from checkpoints.known_models import DEFAULT_MODEL
    from jaxkv.paths import enable_compilation_cache
    from scripts.bench.common import FULL, QUICK, CompileMeter, _median, make_prompts
    from scripts.bench.peer_jaxkv import JaxkvBench, Req, jaxkv_model_source

    enable_compilation_cache()
    sizes = FULL if a.full else QUICK
    model = jaxkv_model_source(a.model or DEFAULT_MODEL)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    meter = CompileMeter()
    with meter.active():
        benches = {tp: JaxkvBench(model, sizes, meter, tensor_parallel_size=tp) for tp in (1, a.tp)}
        stream = benches[1].stream
        res = dict(
            meta=dict(
                model=a.model or DEFAULT_MODEL,
                tp=a.tp,
                runs=a.runs,
                devices=jax.device_count(),
                backend=jax.default_backend(),
                jax=jax.__version__,
            ),
            decode={},
            prefill={},
        )
        for B in sizes.decode_batches:
            prompts = make_prompts(stream, [sizes.decode_prompt] * B)
            rates = {tp: [] for tp in benches}
            for _ in range(a.runs):
                for tp, jb in benches.items():
                    r = jb.decode_run(prompts, sizes.decode_steps)
                    rates[tp].append(r["tokens"] / r["seconds"])
            res["decode"][f"batch{B}"] = _row(rates, a.tp, _median)
            log(f"decode batch {B}: {res['decode'][f'batch{B}']}")
        for n in sizes.prefill_lens:
            prompt = make_prompts(stream, [n])
            rates = {tp: [] for tp in benches}
            for _ in range(a.runs):
                for tp, jb in benches.items():
                    r = jb.engine_run([Req(prompt[0], 1)], sequential=True)
                    rates[tp].append(n / r["wall_s"])
            res["prefill"][f"tokens{n}"] = _row(rates, a.tp, _median)
            log(f"prefill {n}: {res['prefill'][f'tokens{n}']}")
    print(f"| figure | TP 1 tok/s | TP {a.tp} tok/s | ratio |\n|---|---|---|---|")
    for phase in ("decode", "prefill"):
        for name, row in res[phase].items():
            print(
                f"| {phase} {name} | {row['tp1']:.1f} | {row[f'tp{a.tp}']:.1f} | "
                f"{row['ratio']:.2f}x |"
            )
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


def _row(rates: dict, tp: int, median) -> dict:
    m = {f"tp{k}": median(v) for k, v in rates.items()}
    return dict(m, ratio=m[f"tp{tp}"] / m["tp1"], runs={f"tp{k}": v for k, v in rates.items()})


if __name__ == "__main__":
    sys.exit(main())
