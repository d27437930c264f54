"""Overlapped scheduling, side by side with the synchronous engine in one run.

    python scripts/bench/async_scheduling.py [--model smollm2-135m-instruct] [--runs 3]
        [--batch 1 16] [--max-tokens 64] [--decode-steps 1 8] [--json out.json]

For each batch size and decode steps per call, the same greedy workload
(chat prompts, ignore_eos, all submitted at once) runs with
`async_scheduling` off and on, interleaved, medians of `--runs`:

- output tok/s of the whole run;
- wall time per model call (engine step time over decode model calls);
- host time per engine step: engine.step() wall minus the time the host
  sat blocked reading a step's outputs (`runner.stats["wait_seconds"]`).
  Synchronously the device idles for about this long every step (nothing
  is queued while the host reads, schedules, packs and dispatches); with
  overlap the next step is already queued, so it hides behind the device
  as long as it is shorter than the step itself.

- XLA idle ms per step (with `--trace-steps N`, default 8): a
  `jax.profiler` trace of N steps in the middle of a run (all sequences
  decoding); busy = the union of XLA's events on the CPU plane (the PjRt
  client's executions and the Eigen worker threads), idle = the rest of the
  span between the first and the last, per step. This is the time the
  "device" waited for the host.

Outputs of the two modes are compared (the same tokens, or the script
fails). On a CPU "the device" is XLA's threads on the same cores as the
host, so the overlap competes for them; `scripts/device/check.sh` measures
the device's own idle time on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.common import TEXT, _cpu_name, _loadavg, _num_cores
from scripts.device.profile_parts import busy_span

QUESTIONS = [
    "What is a KV cache?",
    "Explain paged attention in two sentences.",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "List three uses of a hash map.",
    "Summarize: " + TEXT[:300],
    "How do I reverse a list in Python?",
    "Give me a recipe for pancakes.",
]


def engine(module, tok, asyn: bool, steps: int, batch: int):
    from jaxkv import LLMEngine
    from jaxkv.config import EngineConfig

    return LLMEngine(
        module,
        tok,
        EngineConfig(
            num_pages=64 * batch + 64,
            page_size=16,
            max_num_seqs=max(batch, 1),
            max_num_batched_tokens=512,
            num_decode_steps=steps,
            async_scheduling=asyn,
            warmup=False,
        ),
    )


def run(eng, prompts, max_tokens: int) -> dict:
    from jaxkv import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    st, rs = dict(eng.stats), dict(eng.runner.stats)
    t0 = time.perf_counter()
    ids = [eng.add_request({"prompt_token_ids": p}, params) for p in prompts]
    final = eng.run_to_completion(ids)
    wall = time.perf_counter() - t0
    d = {
        k: eng.stats[k] - st[k]
        for k in ("steps", "decode_steps", "step_seconds", "overlapped_steps")
    }
    wait = eng.runner.stats["wait_seconds"] - rs["wait_seconds"]
    tokens = [final[i].outputs[0].token_ids for i in ids]
    return dict(
        tokens=tokens,
        output_tok_s=sum(map(len, tokens)) / wall,
        ms_per_model_call=1e3 * d["step_seconds"] / max(d["decode_steps"], 1),
        host_ms_per_step=1e3 * (d["step_seconds"] - wait) / max(d["steps"], 1),
        steps=d["steps"],
        overlapped=d["overlapped_steps"],
    )


def xla_busy(trace_dir: str) -> tuple[float, float]:
    """(span, busy) seconds of XLA's work in a CPU trace: the union of the
    events on the CPU plane's XLA lines (PjRt client, Eigen threads)."""
    import jax

    files = sorted(Path(trace_dir).rglob("*.xplane.pb"))
    spans = []
    for plane in jax.profiler.ProfileData.from_file(str(files[-1])).planes:
        for line in plane.lines:
            if "XLA" in line.name:
                spans += [
                    (e.start_ns, e.start_ns + e.duration_ns)
                    for e in line.events
                    if e.duration_ns > 0
                ]
    span, busy = busy_span(spans)
    return span / 1e9, busy / 1e9


def traced_idle(eng, prompts, max_tokens: int, steps: int) -> float:
    """XLA idle ms per engine step over `steps` steps of a run, traced once
    every sequence decodes."""
    import tempfile

    import jax

    from jaxkv import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [eng.get_request(eng.add_request({"prompt_token_ids": p}, params)) for p in prompts]
    while any(not s.num_output_tokens for s in seqs) and eng.has_unfinished_requests():
        eng.step()
    for _ in range(2):
        eng.step()
    with tempfile.TemporaryDirectory(prefix="bench-async-trace-") as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                eng.step()
        span, busy = xla_busy(trace_dir)
    eng.run_to_completion()
    return 1e3 * (span - busy) / steps


def bench(module, tok, a) -> list[dict]:
    chats = [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    rows = []
    for B in a.batch:
        prompts = [chats[i % len(chats)] for i in range(B)]
        for K in a.decode_steps:
            engines = {m: engine(module, tok, m == "async", K, B) for m in ("sync", "async")}
            for eng in engines.values():  # compile what the timed runs use (the second
                for _ in range(2):  # pass hits the prefix cache: other shapes)
                    run(eng, prompts, a.max_tokens)
            runs = {m: [] for m in engines}
            for _ in range(a.runs):
                for m, eng in engines.items():
                    runs[m].append(run(eng, prompts, a.max_tokens))
            if runs["sync"][0]["tokens"] != runs["async"][0]["tokens"]:
                raise SystemExit(f"batch {B}, {K} steps per call: async outputs differ")
            row = dict(batch=B, decode_steps=K)
            for m, rs in runs.items():
                for f in ("output_tok_s", "ms_per_model_call", "host_ms_per_step"):
                    row[f"{m}_{f}"] = statistics.median(r[f] for r in rs)
                row[f"{m}_overlapped_share"] = rs[0]["overlapped"] / rs[0]["steps"]
            row["speedup"] = row["async_output_tok_s"] / row["sync_output_tok_s"]
            if a.trace_steps:
                for m, eng in engines.items():
                    row[f"{m}_xla_idle_ms_per_step"] = traced_idle(
                        eng, prompts, a.max_tokens, a.trace_steps
                    )
            rows.append(row)
            print(report_row(row), flush=True)
    return rows


def report_row(r: dict) -> str:
    return (
        f"| {r['batch']} | {r['decode_steps']} | {r['sync_output_tok_s']:.1f} | "
        f"{r['async_output_tok_s']:.1f} | {r['speedup']:.2f}x | "
        f"{r['sync_ms_per_model_call']:.1f} / {r['async_ms_per_model_call']:.1f} | "
        f"{r['sync_host_ms_per_step']:.1f} / {r['async_host_ms_per_step']:.1f} | "
        f"{r['async_overlapped_share']:.0%} | "
        f"{r.get('sync_xla_idle_ms_per_step', float('nan')):.1f} / "
        f"{r.get('async_xla_idle_ms_per_step', float('nan')):.1f} |"
    )


HEADER = (
    "| batch | decode steps per call | sync tok/s | async tok/s | speed-up | "
    "ms per model call (sync / async) | host ms per step (sync / async) | "
    "steps overlapped | traced XLA idle ms per step (sync / async) |\n"
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--decode-steps", type=int, nargs="+", default=[1, 8])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--trace-steps",
        type=int,
        default=8,
        help="engine steps traced per mode for XLA idle time (0: no trace)",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    from checkpoints.loader import load_model
    from jaxkv.paths import enable_compilation_cache

    enable_compilation_cache()
    module, tok = load_model(a.model)
    print(HEADER, flush=True)
    res = dict(
        date=time.strftime("%Y-%m-%d"),
        cpu=_cpu_name(),
        cores=_num_cores(),
        model=a.model,
        runs=a.runs,
        max_tokens=a.max_tokens,
        loadavg=_loadavg(),
    )
    res["rows"] = bench(module, tok, a)
    if a.json:  # the rows were printed as they came
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
