"""Generation benchmarks: jaxkv on the default model, optionally against
Hugging Face transformers on the same GGUF, in the same process.

    python scripts/bench/generation.py [--peer hf] [--peer llamacpp] [--json out.json] [--quick] [--runs N]
                            [--quantize w8a8] [--also-quantize w8a8]

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
  memory bandwidth, and the engine's host time per step. With
  `--also-quantize w8a8`, an engine on w8a8 weights decodes at HF's
  batches too, interleaved ("variants").
- prefill: one request of n prompt tokens, max_tokens 1, through an engine
  whose token budget holds the whole prompt (one step, as HF's one
  forward), and `prefill_chunked` lengths through the default engine
  (chunks of its default budget, 512 tokens); HF runs one forward with
  logits at the last row only. tok/s = n / time to the first token, which
  is also the time-to-first-token figure.
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
compare runs taken under similar load) and the HF thread choice. With
`--json out.json` the table is also drawn, tok/s by phase and batch with
the peer beside jaxkv, as `out.png` next to it.

JSON layout (ratio = jaxkv / hf for throughput, hf / jaxkv for latency, so
> 1 means jaxkv is faster):

    results["decode"]["batch16"]["jaxkv"]["tok_per_s"], ...["hf"]..., ...["ratio"]
    results["decode"]["batch1"]["variants"]["w8a8"]["tok_per_s"]
    results["prefill"]["tokens256"]["jaxkv"]["tok_per_s"], ...["ttft_ms"],
        results["prefill"]["tokens4096_chunked"]...
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
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.common import (  # noqa: F401
    FULL,
    QUICK,
    TEXT,
    CompileMeter,
    Sizes,
    _cpu_name,
    _loadavg,
    _median,
    _num_cores,
    e2e_lengths,
    make_prompts,
    measure_bandwidth,
    prompt_stream,
)
from scripts.bench.peer_hf import HFBench
from scripts.bench.peer_jaxkv import DEFAULT_MODEL, JaxkvBench, jaxkv_model_source
from scripts.bench.phases import decode_phase, e2e_phase, prefill_phase, ttft_summary
from scripts.bench.plot import write_plot
from scripts.bench.report import evaluate_goals, format_report  # noqa: F401 (re-exported)


def run_benchmarks(
    model: str = DEFAULT_MODEL,
    *,
    peer: str | tuple[str, ...] | None = None,
    sizes: Sizes = FULL,
    runs: int = 3,
    cold_compile: bool = False,
    quantize: str | None = None,
    also_quantize: tuple[str, ...] = (),
    engine_options: dict | None = None,
    log=print,
) -> dict[str, Any]:
    """Run every phase; returns the results dict (see the module docstring).
    `cold_compile` turns JAX's persistent compilation cache off, so every
    program compiles from scratch as on a machine that never ran jaxkv.
    `also_quantize`: weight formats whose engines also run the decode
    batches HF runs, side by side. `engine_options`: more EngineConfig
    fields for the engines (a test's smaller max_num_seqs: fewer programs)."""
    import jax

    if runs < 1:
        raise ValueError(f"runs: must be >= 1, got {runs}")
    peer_names = (peer,) if isinstance(peer, str) else tuple(peer or ())
    peer = "+".join(peer_names) or None
    if cold_compile:
        jax.config.update("jax_enable_compilation_cache", False)
    else:
        from jaxkv.paths import enable_compilation_cache

        enable_compilation_cache()
    t_start = time.perf_counter()
    meter = CompileMeter()
    res: dict[str, Any] = dict(
        meta=dict(
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            model=model,
            peer=peer,
            runs=runs,
            quantize=quantize,
            sizes=dataclasses.asdict(sizes),
            cpu=_cpu_name(),
            cores=_num_cores(),
            platform=platform.platform(),
            python=platform.python_version(),
            jax=jax.__version__,
            numpy=np.__version__,
            jax_backend=jax.default_backend(),
            loadavg_start=_loadavg(),
        )
    )
    log(f"bench: memory bandwidth over {sizes.bandwidth_bytes >> 20} MiB ...")
    res["bandwidth"] = bw = measure_bandwidth(sizes.bandwidth_bytes)
    with meter.active():
        log(f"bench: loading {model} ...")
        src = jaxkv_model_source(model)
        jx = JaxkvBench(src, sizes, meter, quantize, engine_options=engine_options)
        # Lone prompts in one step: an engine whose budget holds the longest.
        jl = JaxkvBench(
            src, sizes, meter, share=jx, max_num_batched_tokens=max(sizes.prefill_lens, default=16)
        )
        variants = {
            q: JaxkvBench(src, sizes, meter, q, engine_options=engine_options)
            for q in also_quantize
        }
        benches = dict(
            engine=jx, prefill_engine=jl, **{f"engine_{q}": v for q, v in variants.items()}
        )
        hf = HFBench(model, _num_cores()) if "hf" in peer_names else None
        peers = ()
        if "llamacpp" in peer_names:
            from scripts.bench.peer_llamacpp import LlamaCppBench

            peers = (LlamaCppBench(model, _num_cores()),)
            res["meta"].update(
                {f"llamacpp_{k}": v for k, v in peers[0].versions.items()},
                llamacpp_load_s=peers[0].load_s,
            )
        res["meta"]["jaxkv_load_s"] = jx.load_s
        res["meta"]["engine"] = {
            k: v
            for k, v in dataclasses.asdict(jx.engine.config).items()
            if isinstance(v, (int, float, str, bool, type(None)))
        }
        res["meta"]["persistent_compilation_cache"] = bool(
            jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
        )
        if hf is not None:
            res["meta"]["hf_load_s"] = hf.load_s
            res["meta"].update({f"hf_{k}": v for k, v in hf.versions.items()})
        res["model"] = dict(
            weight_bytes=jx.weight_bytes,
            kv_bytes_per_token=jx.kv_bytes_per_token,
            num_layers=jx.config.num_layers,
            vocab_size=jx.config.vocab_size,
        )
        res["decode"] = decode_phase(jx, hf, sizes, runs, bw, log, variants, peers)
        res["prefill"] = prefill_phase(jx, jl, hf, sizes, runs, log, peers)
        res["e2e"] = e2e_phase(jx, sizes, runs, log, hf)
    res["ttft"] = ttft_summary(res)
    res["compile"] = dict(
        programs=sum(len(b.runner.compiled) for b in benches.values()),
        xla_compiles=meter.compiles,
        cache_hits=meter.cache_hits,
        seconds=meter.seconds,
        warm_up_s=jx.warm_up["wall_s"],
        warm_up={k: b.warm_up for k, b in benches.items()},
    )
    res["goals"] = evaluate_goals(res)
    res["meta"]["loadavg_end"] = _loadavg()
    res["meta"]["total_s"] = time.perf_counter() - t_start
    return res


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/bench/generation.py",
        description="Generation benchmarks (decode, prefill, end to end); "
        "prints a markdown table and optionally writes JSON.",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model name or path (a GGUF file or Hugging Face folder for --peer hf) "
        "(default: %(default)s, read from its GGUF)",
    )
    p.add_argument(
        "--peer",
        choices=["hf", "llamacpp"],
        action="append",
        default=[],
        help="also run a peer on the same weights, interleaved with jaxkv, and print "
        "the ratios (repeatable): hf, Hugging Face transformers (torch CPU, "
        "float32); llamacpp, llama-cpp-python on the same GGUF (optional, "
        "installed by hand; batch-1 decode and prefill)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="write the results here")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller workloads (8 decode steps, prefill 256 only, 16 e2e requests)",
    )
    p.add_argument(
        "--runs", type=int, default=3, help="timed runs per figure (default: %(default)s)"
    )
    p.add_argument(
        "--quantize",
        choices=["int8", "w8a8", "float32", "gguf-blocks"],
        default=None,
        help="jaxkv weight format (default: the engine's, a GGUF's weights kept in their "
        "blocks on CPU; float32: every weight dequantized; see jaxkv generate --help)",
    )
    p.add_argument(
        "--also-quantize",
        choices=["int8", "w8a8", "float32", "gguf-blocks"],
        action="append",
        default=[],
        help="also decode at HF's batches with these jaxkv weights (another "
        "engine), side by side (repeatable); gguf-blocks: a GGUF's weights kept "
        "in their blocks (gguf_blocks); float32: every weight dequantized",
    )
    p.add_argument(
        "--cold-compile",
        action="store_true",
        help="turn JAX's persistent compilation cache off: compile times as on a "
        "machine that never ran jaxkv",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.runs < 1:
        _parser().error("--runs must be >= 1")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    res = run_benchmarks(
        a.model,
        peer=a.peer,
        sizes=QUICK if a.quick else FULL,
        runs=a.runs,
        cold_compile=a.cold_compile,
        quantize=a.quantize,
        also_quantize=tuple(a.also_quantize),
        log=log,
    )
    print(format_report(res))
    if a.json:
        path = Path(a.json)
        path.write_text(json.dumps(res, indent=1, default=float) + "\n")
        log(f"bench: wrote {path}")
        png = write_plot(res, path.with_suffix(".png"))
        log(f"bench: wrote {png}" if png else "bench: no plot (matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
