"""Where the time of `scripts/bench/generation.py`'s e2e phase goes: the 64 mixed
requests (the same prompt and output lengths) submitted at once to the
default engine, every runner call recorded (program kind and padded shape,
real rows and sequences, decode steps, dispatch-to-outputs seconds), and
the wall time split into device calls by kind and the engine's host time
around them. Medians of `--runs` runs after one untimed run.

    python scripts/bench/profile_e2e.py [--model smollm2-135m-instruct] [--quantize gguf-blocks]
                                  [--runs 3] [--json out.json]

The same engine options as `bench.py` (prefix caching on; each run salts
its prompts so no run reuses another's pages).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file


def _profile_run(jx, reqs) -> dict:
    runner = jx.runner
    calls = []
    dispatch, fetch = runner.dispatch, runner.fetch

    def rec_dispatch(plan):
        p = dispatch(plan)
        p._prof = dict(
            kind=p.key.kind,
            tokens=p.key.tokens,
            seqs=p.key.seqs,
            rows=plan.num_rows,
            live=plan.num_seqs,
            steps=plan.num_steps,
            prefill_rows=int((plan.q_lens[plan.q_lens > 1]).sum()),
            t0=p.t0,
        )
        return p

    def rec_fetch(p):
        res = fetch(p)
        info = getattr(p, "_prof", None)
        if info is not None:
            info["s"] = time.perf_counter() - info.pop("t0")
            info["tokens_out"] = int(res.counts.sum())
            calls.append(info)
        return res

    runner.dispatch, runner.fetch = rec_dispatch, rec_fetch
    try:
        t = time.perf_counter()
        out = jx.engine_run(reqs, sequential=False)
        wall = time.perf_counter() - t
    finally:
        runner.dispatch, runner.fetch = dispatch, fetch
    by = collections.defaultdict(
        lambda: dict(calls=0, s=0.0, rows=0, padded_rows=0, prefill_rows=0, steps=0, tokens_out=0)
    )
    for c in calls:
        name = "mixed (prefill chunks)" if c["prefill_rows"] else f"decode ({c['kind']})"
        b = by[name]
        b["calls"] += 1
        b["s"] += c["s"]
        b["rows"] += c["rows"] * c["steps"]
        b["padded_rows"] += c["tokens"] * c["steps"]
        b["prefill_rows"] += c["prefill_rows"]
        b["steps"] += c["steps"]
        b["tokens_out"] += c["tokens_out"]
    device = sum(c["s"] for c in calls)
    return dict(
        wall_s=wall,
        output_tokens=out["output_tokens"],
        device_calls_s=device,
        host_outside_calls_s=wall - device,
        by_kind=dict(by),
        calls=calls,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--quantize", default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)

    from jaxkv.paths import enable_compilation_cache
    from scripts.bench.common import FULL, CompileMeter, e2e_lengths, make_prompts
    from scripts.bench.peer_jaxkv import JaxkvBench, Req, jaxkv_model_source

    enable_compilation_cache()
    jx = JaxkvBench(jaxkv_model_source(a.model), FULL, CompileMeter(), a.quantize)
    plens, olens = e2e_lengths(FULL)
    reqs = [Req(pr, o) for pr, o in zip(make_prompts(jx.stream, plens), olens)]
    jx.engine_run(reqs, sequential=False)  # untimed
    runs = [_profile_run(jx, reqs) for _ in range(a.runs)]
    runs.sort(key=lambda r: r["wall_s"])
    m = runs[(len(runs) - 1) // 2]
    walls = ", ".join(f"{r['wall_s']:.2f}" for r in runs)
    print(
        f"{len(reqs)} requests, {sum(plens)} prompt + {sum(olens)} output tokens; "
        f"median run {m['wall_s']:.2f} s ({m['output_tokens'] / m['wall_s']:.1f} output tok/s; "
        f"runs {walls} s)"
    )
    print("| part | calls | steps | rows (real / padded) | prefill rows | seconds | share |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, b in sorted(m["by_kind"].items()):
        print(
            f"| {name} | {b['calls']} | {b['steps']} | {b['rows']} / {b['padded_rows']} | "
            f"{b['prefill_rows']} | {b['s']:.2f} | {b['s'] / m['wall_s']:.0%} |"
        )
    print(
        f"| host outside the calls | | | | | {m['host_outside_calls_s']:.2f} | "
        f"{m['host_outside_calls_s'] / m['wall_s']:.0%} |"
    )
    if a.json:
        a.json.write_text(
            json.dumps(
                dict(
                    model=a.model,
                    quantize=a.quantize,
                    runs_wall_s=[r["wall_s"] for r in runs],
                    median=m,
                    median_wall_s=statistics.median(r["wall_s"] for r in runs),
                ),
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
