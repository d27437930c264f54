"""The timed phases of scripts/bench/generation.py (decode, prefill, end to end) and
the time-to-first-token summary; see bench.py for the JSON layout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from scripts.bench.common import Sizes, _median, e2e_lengths, make_prompts
from scripts.bench.peer_hf import HFBench
from scripts.bench.peer_jaxkv import JaxkvBench, Req


def _entry(measured: list[tuple[float, int]], **extra) -> dict[str, Any]:
    """A figure from (seconds, tokens) per run: the median rate."""
    rates = [n / t for t, n in measured]
    return dict(
        tok_per_s=_median(rates),
        seconds=_median([t for t, _ in measured]),
        tokens=int(_median([n for _, n in measured])),
        runs_seconds=[t for t, _ in measured],
        runs_tokens=[n for _, n in measured],
        runs_tok_per_s=rates,
        **extra,
    )


def _median_run(runs: list[dict], rate: Callable[[dict], float]) -> dict:
    """The run with the median rate (the lower middle one for an even count)."""
    order = sorted(runs, key=rate)
    return order[(len(order) - 1) // 2]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def decode_phase(
    jx: JaxkvBench,
    hf: HFBench | None,
    sizes: Sizes,
    runs: int,
    bw: dict,
    log,
    variants: dict[str, JaxkvBench] | None = None,
    peers: tuple = (),
) -> dict[str, Any]:
    """Decode at each batch; `variants` (name -> the engine on other
    weights, e.g. w8a8) run the same decodes at the batches HF runs,
    interleaved with the others (entry["variants"][name]); `peers`: more
    peers (`bench_llamacpp.LlamaCppBench`) at the batches they decode
    (entry[peer.name], entry["ratio_vs_" + peer.name])."""
    P, N = sizes.decode_prompt, sizes.decode_steps
    prompts = make_prompts(jx.stream, [P] * max(sizes.decode_batches))
    out: dict[str, Any] = {}
    for B in sizes.decode_batches:
        hf_state = None
        if hf is not None and B in sizes.hf_decode_batches:
            hf_state = hf.decode_setup(prompts[:B])
            hf.decode_run(hf_state, 2)
        vs = {k: v for k, v in (variants or {}).items() if B in sizes.hf_decode_batches}
        ps = {}
        for p in peers if B in sizes.hf_decode_batches else ():
            if (st := p.decode_setup(prompts[:B])) is not None:
                p.decode_run(st, 2)
                ps[p.name] = (p, st, [])
        jr, ht, vr = [], [], {k: [] for k in vs}
        for r in range(runs):
            jr.append(jx.decode_run(prompts[:B], N))
            for k, v in vs.items():
                vr[k].append(v.decode_run(prompts[:B], N))
            if hf_state is not None:
                ht.append(hf.decode_run(hf_state, N))
            for p, st, times in ps.values():
                times.append(p.decode_run(st, N))
            log(
                f"bench: decode batch {B} run {r + 1}/{runs}: jaxkv "
                f"{jr[-1]['tokens'] / jr[-1]['seconds']:.1f} tok/s"
                + "".join(f", {k} {x[-1]['tokens'] / x[-1]['seconds']:.1f}" for k, x in vr.items())
                + (f", hf {B * N / ht[-1]:.1f} tok/s" if ht else "")
                + "".join(f", {k} {B * N / t[-1]:.1f} tok/s" for k, (_, _, t) in ps.items())
            )
        m = _median_run(jr, lambda x: x["tokens"] / x["seconds"])
        steps = m["tokens"] / B
        # Each decode step reads the weights once and every sequence's live K/V.
        step_bytes = jx.weight_bytes + jx.kv_bytes_per_token * m["kv_tokens_per_step"]
        e = _entry(
            [(x["seconds"], x["tokens"]) for x in jr],
            step_ms=1e3 * m["seconds"] / steps,
            engine_calls=m["engine_steps"],
            host_overhead_ms_per_step=1e3 * (m["seconds"] - m["runner_s"]) / steps,
            new_compiles_in_timed_runs=sum(x["new_compiles"] for x in jr),
            bytes_per_step=step_bytes,
        )
        e["bytes_per_s"] = step_bytes * steps / m["seconds"]
        e["bandwidth_fraction"] = e["bytes_per_s"] / bw["read_bytes_per_s"]
        # The bandwidth limit: one full read of weights + live K/V per step.
        e["bandwidth_limit_tok_per_s"] = B * bw["read_bytes_per_s"] / step_bytes
        entry: dict[str, Any] = dict(batch=B, prompt_tokens=P, decode_steps=N, jaxkv=e)
        if ht:
            entry["hf"] = _entry([(t, B * N) for t in ht], step_ms=1e3 * _median(ht) / N)
            entry["ratio"] = _ratio(e["tok_per_s"], entry["hf"]["tok_per_s"])
        for k, (_, _, times) in ps.items():
            entry[k] = _entry([(t, B * N) for t in times], step_ms=1e3 * _median(times) / N)
            entry[f"ratio_vs_{k}"] = _ratio(e["tok_per_s"], entry[k]["tok_per_s"])
        if vr:
            entry["variants"] = {
                k: _entry(
                    [(x["seconds"], x["tokens"]) for x in xs],
                    new_compiles_in_timed_runs=sum(x["new_compiles"] for x in xs),
                )
                for k, xs in vr.items()
            }
            for k, v in entry["variants"].items():
                v["ratio_vs_jaxkv"] = _ratio(v["tok_per_s"], e["tok_per_s"])
                if "hf" in entry:
                    v["ratio"] = _ratio(v["tok_per_s"], entry["hf"]["tok_per_s"])
                for k in ps:
                    v[f"ratio_vs_{k}"] = _ratio(v["tok_per_s"], entry[k]["tok_per_s"])
        out[f"batch{B}"] = entry
    return out


def prefill_phase(
    jx: JaxkvBench,
    jl: JaxkvBench,
    hf: HFBench | None,
    sizes: Sizes,
    runs: int,
    log,
    peers: tuple = (),
) -> dict[str, Any]:
    """Prefill n tokens in one step (`jl`, the lone-prompt engine whose
    budget holds the longest prompt), and in chunks of the default token
    budget (`jx`); HF runs one forward either way (its figure for the same
    length is reused for the chunked one)."""
    out: dict[str, Any] = {}
    lens = [(n, False) for n in sizes.prefill_lens] + [(n, True) for n in sizes.prefill_chunked]
    for i, (n, chunked) in enumerate(lens):
        prompt = make_prompts(jx.stream, [n] * (i + 1))[i]
        eng = jx if chunked else jl
        budget = eng.engine.config.max_num_batched_tokens
        reqs = [Req(prompt, 1)]
        peer = hf is not None and not (chunked and f"tokens{n}" in out)
        if peer:
            hf.prefill(prompt)
        more = {} if chunked else {p.name: (p, []) for p in peers}
        for p, _ in more.values():
            p.prefill(prompt)
        jr, ht = [], []
        for r in range(runs):
            jr.append(eng.engine_run(reqs, sequential=False))
            if peer:
                ht.append(hf.prefill(prompt))
            for p, times in more.values():
                times.append(p.prefill(prompt))
            log(
                f"bench: prefill {n}{' chunked' if chunked else ''} run {r + 1}/{runs}: jaxkv "
                f"{n / jr[-1]['ttft_s'][0]:.1f} tok/s"
                + (f", hf {n / ht[-1]:.1f} tok/s" if ht else "")
                + "".join(f", {k} {n / t[-1]:.1f} tok/s" for k, (_, t) in more.items())
            )
        jt = [x["ttft_s"][0] for x in jr]
        e = _entry(
            [(t, n) for t in jt],
            ttft_ms=1e3 * _median(jt),
            new_compiles_in_timed_runs=sum(x["new_compiles"] for x in jr),
        )
        entry: dict[str, Any] = dict(
            batch=1, prompt_tokens=n, token_budget=budget, steps=-(-n // budget), jaxkv=e
        )
        if ht:
            entry["hf"] = _entry([(t, n) for t in ht], ttft_ms=1e3 * _median(ht))
        elif hf is not None:
            entry["hf"] = out[f"tokens{n}"]["hf"]
        if "hf" in entry:
            entry["ratio"] = _ratio(e["tok_per_s"], entry["hf"]["tok_per_s"])
        for k, (_, times) in more.items():
            entry[k] = _entry([(t, n) for t in times], ttft_ms=1e3 * _median(times))
            entry[f"ratio_vs_{k}"] = _ratio(e["tok_per_s"], entry[k]["tok_per_s"])
        out[f"tokens{n}{'_chunked' if chunked else ''}"] = entry
    return out


def e2e_phase(jx: JaxkvBench, sizes: Sizes, runs: int, log, hf=None) -> dict[str, Any]:
    plens, olens = e2e_lengths(sizes)
    reqs = [Req(p, o) for p, o in zip(make_prompts(jx.stream, plens), olens)]
    out: dict[str, Any] = dict(num_requests=len(reqs), prompt_lens=plens, output_lens=olens)
    for mode, n_runs in (("batched", runs), ("sequential", min(runs, sizes.sequential_runs))):
        seq = mode == "sequential"
        rs = []
        for r in range(n_runs):
            rs.append(jx.engine_run(reqs, sequential=seq))
            log(
                f"bench: e2e {mode} run {r + 1}/{n_runs}: "
                f"{rs[-1]['output_tokens'] / rs[-1]['wall_s']:.1f} output tok/s, "
                f"{rs[-1]['wall_s']:.1f} s"
            )
        m = _median_run(rs, lambda x: x["output_tokens"] / x["wall_s"])
        e = _entry(
            [(x["wall_s"], x["output_tokens"]) for x in rs],
            total_tok_per_s=_median(
                [(x["output_tokens"] + x["prompt_tokens"]) / x["wall_s"] for x in rs]
            ),
            output_tokens=m["output_tokens"],
            prompt_tokens=m["prompt_tokens"],
            engine_calls=m["engine_steps"],
            runs=n_runs,
            host_overhead_s=m["wall_s"] - m["runner_s"],
            host_overhead_ms_per_call=(1e3 * (m["wall_s"] - m["runner_s"]) / m["engine_steps"]),
            ttft_ms_median=1e3 * _median(m["ttft_s"]),
            ttft_ms_p90=1e3 * float(np.percentile(m["ttft_s"], 90)),
            ttft_ms_max=1e3 * max(m["ttft_s"]),
            new_compiles_in_timed_runs=sum(x["new_compiles"] for x in rs),
        )
        out[mode] = dict(jaxkv=e)
    out["ratio_batched_over_sequential"] = _ratio(
        out["batched"]["jaxkv"]["tok_per_s"], out["sequential"]["jaxkv"]["tok_per_s"]
    )
    if hf is not None:  # HF's batched generate: one static batch of the same requests
        prompts = [r.prompt for r in reqs]
        hs = []
        for r in range(runs):
            hs.append(hf.generate_batched(prompts, olens))
            log(
                f"bench: e2e hf batched generate run {r + 1}/{runs}: "
                f"{hs[-1]['output_tokens'] / hs[-1]['wall_s']:.1f} output tok/s"
            )
        b = out["batched"]
        b["hf"] = _entry(
            [(x["wall_s"], x["output_tokens"]) for x in hs],
            generated_tokens=hs[0]["generated_tokens"],
            runs=runs,
        )
        b["ratio"] = _ratio(b["jaxkv"]["tok_per_s"], b["hf"]["tok_per_s"])
    return out


def ttft_summary(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, entry in res["prefill"].items():
        t = dict(jaxkv=dict(ms=entry["jaxkv"]["ttft_ms"]))
        if "hf" in entry:
            t["hf"] = dict(ms=entry["hf"]["ttft_ms"])
            t["ratio"] = _ratio(t["hf"]["ms"], t["jaxkv"]["ms"])
        out[key.replace("tokens", "prompt")] = t
    b = res["e2e"]["batched"]["jaxkv"]
    out["e2e_batched"] = dict(
        jaxkv=dict(ms_median=b["ttft_ms_median"], ms_p90=b["ttft_ms_p90"], ms_max=b["ttft_ms_max"])
    )
    return out
