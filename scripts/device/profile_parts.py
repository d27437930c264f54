"""The profile part of scripts/device/check.sh (run through
device_check_engine.py --part profile), and the random Llama of a given
shape the engine parts build.

profile: 64 sequences decoding from 1024-token prompts. Per engine step,
wall time of engine.step() minus the runner's time in it (runner.stats: the
jitted call until its outputs are on the host) = host time with nothing
queued on the device; then a jax.profiler trace of a few steps
(DIR/profile_trace): busy = union of the GPU stream events, idle = the rest
of the traced span. HBM fraction: (weight + live K/V bytes) per model decode
step / its runner time / 4.8e12 B/s (H200 datasheet; CPU: nominal 50 GB/s).
Then overlapped scheduling on the same engine, one model call per step:
wall per step and traced device idle per step, synchronous and overlapped
(`async_scheduling`).
"""

from __future__ import annotations

import time
from pathlib import Path

from scripts.device import results as lib


def random_llama(shape: dict, dtype):
    """A Llama of an HF-style `shape`, random_init's scales drawn by jax.random."""
    import jax
    import jax.numpy as jnp

    from jaxkv.config import ModelConfig
    from jaxkv.model.llama import Llama

    names = dict(
        num_hidden_layers="num_layers",
        num_attention_heads="num_heads",
        num_key_value_heads="num_kv_heads",
    )
    cfg = ModelConfig(
        architecture="llama",
        **{names.get(k, k): v for k, v in shape.items()},
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
    )
    base = jax.random.key(0)

    def init(name, shape):
        k = jax.random.fold_in(base, sum(ord(c) * 31**i for i, c in enumerate(name)) % 2**31)
        x = jax.random.normal(k, shape, jnp.float32)
        if name.endswith("norm"):
            return (1.0 + 0.1 * x).astype(dtype)
        fan_in = shape[0] * (shape[1] if name.endswith(".wo") else 1) if len(shape) > 1 else 1
        return ((0.02 if name == "embed" else fan_in**-0.5) * x).astype(dtype)

    return Llama(cfg, init)


def part_profile(a, log):
    import jax
    import jax.numpy as jnp

    from jaxkv import LLMEngine, SamplingParams
    from jaxkv.config import EngineConfig

    deadline = time.monotonic() + a.budget_s
    shape = lib.TINY_THROUGHPUT_SHAPE if a.smoke else lib.LLAMA_1B_SHAPE
    S, P = (4, 32) if a.smoke else (64, 1024)
    n_warm, n_timed, n_traced, K = (1, 3, 2, 8) if a.smoke else (2, 10, 4, 8)
    n_overlap = (3, 2) if a.smoke else (24, 8)  # timed, traced single-call steps per mode
    max_tokens = (n_warm + n_timed + n_traced + 2) * K + 2 * (sum(n_overlap) + 4) + 16
    eng = LLMEngine(
        random_llama(shape, jnp.bfloat16),
        None,
        EngineConfig(
            dtype="bfloat16",
            max_num_seqs=S,
            max_num_batched_tokens=64 if a.smoke else 2048,
            num_pages=S * -(-(P + max_tokens) // 16) + 2,
            max_model_len=P + max_tokens,
            num_decode_steps=K,
            warmup=False,
            async_scheduling=False,
        ),
    )
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [
        eng.get_request(eng.add_request({"prompt_token_ids": p}, sp))
        for p in lib.workload(S, (P, P), (1, 1), shape["vocab_size"], seed=5)[0]
    ]
    while any(not s.num_output_tokens for s in seqs):  # prefill
        eng.step()
    for _ in range(n_warm):  # compiles the decode program
        eng.step()
    ctx0, calls0, d0 = (
        sum(s.num_tokens for s in seqs),
        eng.runner.stats["calls"],
        eng.stats["decode_steps"],
    )
    walls, runner = [], []
    for _ in range(n_timed):
        r0, t0 = eng.runner.stats["seconds"], time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t0)
        runner.append(eng.runner.stats["seconds"] - r0)
    ctx1, steps = sum(s.num_tokens for s in seqs), eng.stats["decode_steps"] - d0
    calls = eng.runner.stats["calls"] - calls0
    trace_dir = Path(a.out) / "profile_trace"
    trace = traced_steps(eng, n_traced, trace_dir, deadline)
    overlap = overlap_rows(eng, *n_overlap, Path(a.out), deadline)
    if any(s.finished for s in seqs):
        raise RuntimeError("a sequence finished inside the measured window")
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(eng.runner.state))
    kv_tok = eng.runner.cache.nbytes() // (eng.runner.cache.num_pages * eng.runner.cache.page_size)
    step_bytes = weights + kv_tok * (ctx0 + ctx1) / 2
    dev, kind = jax.devices()[0], getattr(jax.devices()[0], "device_kind", "?")
    peak, label = (
        (
            lib.H200_PEAK,
            "H200 datasheet 4.8e12 B/s" + ("" if "H200" in kind else f" (device is {kind})"),
        )
        if dev.platform == "gpu"
        else (lib.NOMINAL_CPU_PEAK, "nominal CPU peak 50 GB/s, not measured")
    )
    t_dev, t_wall, gap = sum(runner) / steps, sum(walls) / steps, sum(walls) - sum(runner)
    entry = dict(
        batch=S,
        prompt=P,
        engine_steps=n_timed,
        model_decode_steps=steps,
        runner_calls=calls,
        wall_per_engine_step_ms=1e3 * sum(walls) / n_timed,
        runner_per_engine_step_ms=1e3 * sum(runner) / n_timed,
        host_idle_per_engine_step_ms=1e3 * gap / n_timed,
        host_idle_fraction=gap / sum(walls),
        trace=trace,
        trace_dir=str(trace_dir),
        weight_bytes=weights,
        kv_bytes_per_token=kv_tok,
        bytes_per_decode_step=step_bytes,
        decode_step_ms_runner=1e3 * t_dev,
        decode_step_ms_wall=1e3 * t_wall,
        peak_bytes_per_s=peak,
        peak_label=label,
        hbm_fraction_runner=step_bytes / t_dev / peak,
        hbm_fraction_wall=step_bytes / t_wall / peak,
        overlap=overlap,
    )
    idle = (
        f"device idle {trace['idle_per_engine_step_ms']:.2f} ms/step (trace)"
        if trace.get("parsed")
        else f"trace not parsed: {trace['reason'][:70]}"
    )
    entry["summary"] = (
        f"batch {S} decode step {1e3 * t_dev:.2f} ms = "
        f"{entry['hbm_fraction_runner']:.1%} of {label}; host gap "
        f"{1e3 * gap / n_timed:.2f} ms per engine step; {idle}; one call per "
        "step: "
        + ", ".join(
            f"{r['mode']} {r['wall_per_step_ms']:.2f} ms/step"
            + (
                f" (idle {r['idle_per_step_ms']:.2f})"
                if r.get("idle_per_step_ms") is not None
                else ""
            )
            for r in overlap
        )
    )
    return entry


def overlap_rows(eng, n_timed, n_traced, out_dir, deadline) -> list[dict]:
    """Synchronous vs overlapped scheduling on `eng` (its sequences all
    decoding), one model call per step: wall per engine step, and device
    idle per step from a trace (DIR/profile_trace_sync, _async)."""
    eng.scheduler.max_num_steps = 1  # the compiled loop runs one call per step
    rows = []
    for mode in ("sync", "async"):
        eng.async_scheduling = mode == "async"
        for _ in range(3):  # a step in flight before the timing starts
            eng.step()
        t0 = time.perf_counter()
        for _ in range(n_timed):
            eng.step()
        row = dict(mode=mode, wall_per_step_ms=1e3 * (time.perf_counter() - t0) / n_timed)
        tr = traced_steps(eng, n_traced, out_dir / f"profile_trace_{mode}", deadline)
        row.update(trace=tr, idle_per_step_ms=tr.get("idle_per_engine_step_ms"))
        rows.append(row)
    eng.async_scheduling = False
    eng.step()  # read the step left in flight
    return rows


def traced_steps(eng, n: int, trace_dir, deadline) -> dict:
    """`n` engine steps under a jax.profiler trace in `trace_dir`: the
    device's busy and idle time (`device_busy`), or why
    not (budget spent, no device plane, an error)."""
    import jax

    if time.monotonic() > deadline:
        return dict(parsed=False, reason="budget spent")
    try:
        with jax.profiler.trace(str(trace_dir)):
            for _ in range(n):
                eng.step()
        return device_busy(trace_dir, n)
    except Exception as e:
        return dict(parsed=False, reason=f"{type(e).__name__}: {e}")


def busy_span(spans) -> tuple[int, int]:
    """(first start to last end, length of the union) of (start, end) intervals."""
    spans = sorted(spans)
    busy, (lo, hi) = 0, spans[0]
    for s, e in spans[1:]:
        if s > hi:
            busy, lo = busy + hi - lo, s
        hi = max(hi, e)
    return max(e for _, e in spans) - spans[0][0], busy + hi - lo


def device_busy(trace_dir, steps: int) -> dict:
    """Busy (union of the first device plane's stream events) and idle time."""
    import jax

    if not (files := sorted(Path(trace_dir).rglob("*.xplane.pb"))):
        return dict(parsed=False, reason="no .xplane.pb written")
    planes = list(jax.profiler.ProfileData.from_file(str(files[-1])).planes)
    dev = [p for p in planes if p.name.startswith("/device:")]
    if not dev:
        return dict(
            parsed=False,
            reason="no device plane in the trace (planes: "
            + ", ".join(p.name for p in planes)
            + ")",
        )
    lines = [ln for ln in dev[0].lines if ln.name.lower().startswith("stream")]
    spans = sorted((e.start_ns, e.end_ns) for ln in lines for e in ln.events)
    if not spans:
        return dict(parsed=False, reason=f"no stream events on {dev[0].name}")
    span, busy = busy_span(spans)
    return dict(
        parsed=True,
        plane=dev[0].name,
        lines=[ln.name for ln in lines],
        events=len(spans),
        span_ms=span / 1e6,
        busy_ms=busy / 1e6,
        busy_fraction=busy / span if span else None,
        idle_per_engine_step_ms=(span - busy) / 1e6 / steps,
    )
