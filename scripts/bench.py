"""Generation benchmarks: jaxkv on the default model, optionally against
Hugging Face transformers on the same GGUF, in the same process.

    python scripts/bench.py [--peer hf] [--json out.json] [--quick] [--runs N]

Phases (fixed prompts cut from one built-in text; greedy with the end token
ignored, so every run of a phase does the same work):

- decode: B requests with a P-token prompt go through the jaxkv engine;
  once every one has its first token (prefill done, untimed) the engine is
  timed while each sequence decodes N more tokens (pure decode at batch B,
  whatever the engine does for that: one step per call or several), then
  the requests are aborted. HF prefills the same prompts as one batch once
  (untimed) and runs a manual greedy loop of N steps on a copy of that
  cache. tok/s = tokens decoded / time. Also: bytes read per second
  (weights once per step + every sequence's live K/V) against the measured
  memory bandwidth, and the engine's host time per step.
- prefill: one request of n prompt tokens, max_tokens 1, through the
  engine (chunked at max_num_batched_tokens like any request); HF runs one
  forward with logits at the last row only. tok/s = n / time to the first
  token, which is also the time-to-first-token figure.
- e2e: M requests of mixed prompt and output lengths through the engine,
  all submitted at once (batched), and the same M requests one after
  another (sequential). tok/s counts generated tokens.

Warm-up is excluded: the engine compiles every step program when it starts
(its own warm-up, reported under "compile"); timed runs that still compile
say so (`new_compiles_in_timed_runs`, and a WARNING line). jaxkv and HF runs
alternate (jaxkv, hf, jaxkv, hf, ...); each figure is the median over
`--runs` runs (the long sequential e2e pass runs once). The engine runs
with its defaults (prefix caching on) except the pool size; each
submission swaps the first prompt token for a fresh one so no run reuses
another's cached pages. The JSON holds every run's value, versions, the
CPU, the load average before and after (other processes skew CPU timings:
compare runs taken under similar load) and the HF thread choice.

JSON layout (ratio = jaxkv / hf for throughput, hf / jaxkv for latency, so
> 1 means jaxkv is faster):

    results["decode"]["batch16"]["jaxkv"]["tok_per_s"], ...["hf"]..., ...["ratio"]
    results["prefill"]["tokens256"]["jaxkv"]["tok_per_s"], ...["ttft_ms"]
    results["e2e"]["batched"]["jaxkv"]["tok_per_s"], results["e2e"]["sequential"]...,
        results["e2e"]["ratio_batched_over_sequential"]
    results["ttft"]["prompt256"]["jaxkv"]["ms"], results["ttft"]["e2e_batched"]...
    results["bandwidth"]["read_bytes_per_s"], results["compile"]["programs"], ...
    results["goals"] = [{"name", "value", "target", "met"}, ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench_common import (FULL, QUICK, TEXT, CompileMeter, Sizes, _cpu_name,  # noqa: F401
                          _loadavg, _median, _num_cores, e2e_lengths, make_prompts,
                          measure_bandwidth, prompt_stream)
from bench_hf import HFBench
from bench_jaxkv import DEFAULT_MODEL, JaxkvBench, Req, jaxkv_model_source
from bench_report import evaluate_goals, format_report  # noqa: F401 (re-exported)


# ------------------------------------------------------------------ phases


def _entry(measured: list[tuple[float, int]], **extra) -> dict[str, Any]:
    """A figure from (seconds, tokens) per run: the median rate."""
    rates = [n / t for t, n in measured]
    return dict(tok_per_s=_median(rates), seconds=_median([t for t, _ in measured]),
                tokens=int(_median([n for _, n in measured])),
                runs_seconds=[t for t, _ in measured], runs_tokens=[n for _, n in measured],
                runs_tok_per_s=rates, **extra)


def _median_run(runs: list[dict], rate: Callable[[dict], float]) -> dict:
    """The run with the median rate (the lower middle one for an even count)."""
    order = sorted(runs, key=rate)
    return order[(len(order) - 1) // 2]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def run_benchmarks(model: str = DEFAULT_MODEL, *, peer: str | None = None,
                   sizes: Sizes = FULL, runs: int = 3, cold_compile: bool = False,
                   quantize: str | None = None, log=print) -> dict[str, Any]:
    """Run every phase; returns the results dict (see the module docstring).
    `cold_compile` turns JAX's persistent compilation cache off, so every
    program compiles from scratch as on a machine that never ran jaxkv."""
    import jax

    if runs < 1:
        raise ValueError(f"runs: must be >= 1, got {runs}")
    if cold_compile:
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        from jaxkv.paths import enable_compilation_cache
        enable_compilation_cache()
    t_start = time.perf_counter()
    meter = CompileMeter()
    res: dict[str, Any] = dict(meta=dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=model, peer=peer, runs=runs, quantize=quantize, sizes=dataclasses.asdict(sizes),
        cpu=_cpu_name(), cores=_num_cores(), platform=platform.platform(),
        python=platform.python_version(), jax=jax.__version__, numpy=np.__version__,
        jax_backend=jax.default_backend(), loadavg_start=_loadavg()))
    log(f"bench: memory bandwidth over {sizes.bandwidth_bytes >> 20} MiB ...")
    res["bandwidth"] = bw = measure_bandwidth(sizes.bandwidth_bytes)
    with meter.active():
        log(f"bench: loading {model} ...")
        jx = JaxkvBench(jaxkv_model_source(model), sizes, meter, quantize)
        hf = HFBench(model, _num_cores()) if peer == "hf" else None
        res["meta"]["jaxkv_load_s"] = jx.load_s
        res["meta"]["engine"] = {k: v for k, v in dataclasses.asdict(jx.engine.config).items()
                                 if isinstance(v, (int, float, str, bool, type(None)))}
        res["meta"]["persistent_compilation_cache"] = bool(
            jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)
        if hf is not None:
            res["meta"]["hf_load_s"] = hf.load_s
            res["meta"].update({f"hf_{k}": v for k, v in hf.versions.items()})
        res["model"] = dict(weight_bytes=jx.weight_bytes, kv_bytes_per_token=jx.kv_bytes_per_token,
                            num_layers=jx.config.num_layers, vocab_size=jx.config.vocab_size)
        res["decode"] = _decode_phase(jx, hf, sizes, runs, bw, log)
        res["prefill"] = _prefill_phase(jx, hf, sizes, runs, log)
        res["e2e"] = _e2e_phase(jx, sizes, runs, log)
    res["ttft"] = _ttft(res)
    res["compile"] = dict(programs=len(jx.runner.compiled), xla_compiles=meter.compiles,
                          cache_hits=meter.cache_hits, seconds=meter.seconds,
                          warm_up_s=jx.warm_up["wall_s"], warm_up=dict(engine=jx.warm_up))
    res["goals"] = evaluate_goals(res)
    res["meta"]["loadavg_end"] = _loadavg()
    res["meta"]["total_s"] = time.perf_counter() - t_start
    return res


def _decode_phase(jx: JaxkvBench, hf: HFBench | None, sizes: Sizes, runs: int, bw: dict,
                  log) -> dict[str, Any]:
    P, N = sizes.decode_prompt, sizes.decode_steps
    prompts = make_prompts(jx.stream, [P] * max(sizes.decode_batches))
    out: dict[str, Any] = {}
    for B in sizes.decode_batches:
        hf_state = None
        if hf is not None and B in sizes.hf_decode_batches:
            hf_state = hf.decode_setup(prompts[:B])
            hf.decode_run(hf_state, 2)
        jr, ht = [], []
        for r in range(runs):
            jr.append(jx.decode_run(prompts[:B], N))
            if hf_state is not None:
                ht.append(hf.decode_run(hf_state, N))
            log(f"bench: decode batch {B} run {r + 1}/{runs}: jaxkv "
                f"{jr[-1]['tokens'] / jr[-1]['seconds']:.1f} tok/s"
                + (f", hf {B * N / ht[-1]:.1f} tok/s" if ht else ""))
        m = _median_run(jr, lambda x: x["tokens"] / x["seconds"])
        steps = m["tokens"] / B
        # Each decode step reads the weights once and every sequence's live K/V.
        step_bytes = jx.weight_bytes + jx.kv_bytes_per_token * m["kv_tokens_per_step"]
        e = _entry([(x["seconds"], x["tokens"]) for x in jr],
                   step_ms=1e3 * m["seconds"] / steps,
                   engine_calls=m["engine_steps"],
                   host_overhead_ms_per_step=1e3 * (m["seconds"] - m["runner_s"]) / steps,
                   new_compiles_in_timed_runs=sum(x["new_compiles"] for x in jr),
                   bytes_per_step=step_bytes)
        e["bytes_per_s"] = step_bytes * steps / m["seconds"]
        e["bandwidth_fraction"] = e["bytes_per_s"] / bw["read_bytes_per_s"]
        # The bandwidth limit: one full read of weights + live K/V per step.
        e["bandwidth_limit_tok_per_s"] = B * bw["read_bytes_per_s"] / step_bytes
        entry: dict[str, Any] = dict(batch=B, prompt_tokens=P, decode_steps=N, jaxkv=e)
        if ht:
            entry["hf"] = _entry([(t, B * N) for t in ht], step_ms=1e3 * _median(ht) / N)
            entry["ratio"] = _ratio(e["tok_per_s"], entry["hf"]["tok_per_s"])
        out[f"batch{B}"] = entry
    return out


def _prefill_phase(jx: JaxkvBench, hf: HFBench | None, sizes: Sizes, runs: int,
                   log) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, n in enumerate(sizes.prefill_lens):
        prompt = make_prompts(jx.stream, [n] * (i + 1))[i]
        reqs = [Req(prompt, 1)]
        if hf is not None:
            hf.prefill(prompt)
        jr, ht = [], []
        for r in range(runs):
            jr.append(jx.engine_run(reqs, sequential=False))
            if hf is not None:
                ht.append(hf.prefill(prompt))
            log(f"bench: prefill {n} run {r + 1}/{runs}: jaxkv {n / jr[-1]['ttft_s'][0]:.1f} tok/s"
                + (f", hf {n / ht[-1]:.1f} tok/s" if ht else ""))
        jt = [x["ttft_s"][0] for x in jr]
        e = _entry([(t, n) for t in jt], ttft_ms=1e3 * _median(jt),
                   new_compiles_in_timed_runs=sum(x["new_compiles"] for x in jr))
        entry: dict[str, Any] = dict(batch=1, prompt_tokens=n, jaxkv=e)
        if ht:
            entry["hf"] = _entry([(t, n) for t in ht], ttft_ms=1e3 * _median(ht))
            entry["ratio"] = _ratio(e["tok_per_s"], entry["hf"]["tok_per_s"])
        out[f"tokens{n}"] = entry
    return out


def _e2e_phase(jx: JaxkvBench, sizes: Sizes, runs: int, log) -> dict[str, Any]:
    plens, olens = e2e_lengths(sizes)
    reqs = [Req(p, o) for p, o in zip(make_prompts(jx.stream, plens), olens)]
    out: dict[str, Any] = dict(num_requests=len(reqs), prompt_lens=plens, output_lens=olens)
    for mode, n_runs in (("batched", runs), ("sequential", min(runs, sizes.sequential_runs))):
        seq = mode == "sequential"
        rs = []
        for r in range(n_runs):
            rs.append(jx.engine_run(reqs, sequential=seq))
            log(f"bench: e2e {mode} run {r + 1}/{n_runs}: "
                f"{rs[-1]['output_tokens'] / rs[-1]['wall_s']:.1f} output tok/s, "
                f"{rs[-1]['wall_s']:.1f} s")
        m = _median_run(rs, lambda x: x["output_tokens"] / x["wall_s"])
        e = _entry([(x["wall_s"], x["output_tokens"]) for x in rs],
                   total_tok_per_s=_median([(x["output_tokens"] + x["prompt_tokens"]) / x["wall_s"]
                                            for x in rs]),
                   output_tokens=m["output_tokens"], prompt_tokens=m["prompt_tokens"],
                   engine_calls=m["engine_steps"], runs=n_runs,
                   host_overhead_s=m["wall_s"] - m["runner_s"],
                   host_overhead_ms_per_call=(1e3 * (m["wall_s"] - m["runner_s"])
                                              / m["engine_steps"]),
                   ttft_ms_median=1e3 * _median(m["ttft_s"]),
                   ttft_ms_p90=1e3 * float(np.percentile(m["ttft_s"], 90)),
                   ttft_ms_max=1e3 * max(m["ttft_s"]),
                   new_compiles_in_timed_runs=sum(x["new_compiles"] for x in rs))
        out[mode] = dict(jaxkv=e)
    out["ratio_batched_over_sequential"] = _ratio(out["batched"]["jaxkv"]["tok_per_s"],
                                                  out["sequential"]["jaxkv"]["tok_per_s"])
    return out


def _ttft(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, entry in res["prefill"].items():
        t = dict(jaxkv=dict(ms=entry["jaxkv"]["ttft_ms"]))
        if "hf" in entry:
            t["hf"] = dict(ms=entry["hf"]["ttft_ms"])
            t["ratio"] = _ratio(t["hf"]["ms"], t["jaxkv"]["ms"])
        out[key.replace("tokens", "prompt")] = t
    b = res["e2e"]["batched"]["jaxkv"]
    out["e2e_batched"] = dict(jaxkv=dict(ms_median=b["ttft_ms_median"], ms_p90=b["ttft_ms_p90"],
                                         ms_max=b["ttft_ms_max"]))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/bench.py", description="Generation benchmarks (decode, prefill, end to end); "
        "prints a markdown table and optionally writes JSON.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model name or path (a GGUF file or Hugging Face folder for --peer hf) "
                        "(default: %(default)s, read from its GGUF)")
    p.add_argument("--peer", choices=["hf"], default=None,
                   help="also run Hugging Face transformers (torch CPU, float32) on the same "
                        "weights, interleaved with jaxkv, and print the ratios")
    p.add_argument("--json", metavar="PATH", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true",
                   help="smaller workloads (8 decode steps, prefill 256 only, 16 e2e requests)")
    p.add_argument("--runs", type=int, default=3,
                   help="timed runs per figure (default: %(default)s)")
    p.add_argument("--quantize", choices=["int8", "w8a8"], default=None,
                   help="jaxkv weight format (default: float32; see jaxkv generate --help)")
    p.add_argument("--cold-compile", action="store_true",
                   help="turn JAX's persistent compilation cache off: compile times as on a "
                        "machine that never ran jaxkv")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.runs < 1:
        _parser().error("--runs must be >= 1")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    res = run_benchmarks(a.model, peer=a.peer, sizes=QUICK if a.quick else FULL, runs=a.runs,
                         cold_compile=a.cold_compile, quantize=a.quantize, log=log)
    print(format_report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=float) + "\n")
        log(f"bench: wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
