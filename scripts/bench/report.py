"""Goals and the printed report of `jaxkv bench` (see jaxkv.bench for the
results layout)."""

from __future__ import annotations

from typing import Any

# Goals (met / missed is printed next to the numbers). llama.cpp's prefill
# on this class of machine is ~160 tok/s for the default model.
LLAMA_CPP_PREFILL_TOK_S = 160.0
GOAL_DECODE1_VS_HF = 2.0
GOAL_DECODE1_BW_FRACTION = 0.85
GOAL_DECODE16_VS_HF = 3.0
GOAL_E2E_TOK_S = 300.0
GOAL_PREFILL256_VS_LLAMA_CPP = 2.0
GOAL_PREFILL_VS_HF = 1.3  # every prefill length; >= 1.0 is the floor
GOAL_DECODE1_VS_LLAMACPP = 1.0  # batch-1 decode on the same GGUF (--peer llamacpp)
PEERS = ("llamacpp",)  # peers beside hf (entry[name], entry["ratio_vs_" + name])


def evaluate_goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal whose inputs were measured: name, where (the table row),
    label, value, target, met."""
    goals = []

    def add(name, where, value, target, label, shown):
        if value is not None:
            goals.append(
                dict(
                    name=name,
                    where=where,
                    label=label,
                    value=value,
                    target=target,
                    met=bool(value >= target),
                    shown=shown.format(value),
                )
            )

    d1 = res["decode"].get("batch1")
    if d1:
        add(
            "decode batch 1 vs HF",
            "decode/batch1",
            d1.get("ratio"),
            GOAL_DECODE1_VS_HF,
            f">= {GOAL_DECODE1_VS_HF:g}x hf",
            "{:.2f}x",
        )
        limit = res["bandwidth"]["read_bytes_per_s"] / res["model"]["weight_bytes"]
        add(
            "decode batch 1 vs fp32 bandwidth limit",
            "decode/batch1",
            d1["jaxkv"]["tok_per_s"] / limit,
            GOAL_DECODE1_BW_FRACTION,
            f">= {100 * GOAL_DECODE1_BW_FRACTION:.0f}% of bw limit {limit:.1f} tok/s",
            "{:.0%}",
        )
        add(
            "decode batch 1 vs llama.cpp",
            "decode/batch1",
            d1.get("ratio_vs_llamacpp"),
            GOAL_DECODE1_VS_LLAMACPP,
            f">= {GOAL_DECODE1_VS_LLAMACPP:g}x llama.cpp",
            "{:.2f}x",
        )
    d16 = res["decode"].get("batch16")
    if d16:
        add(
            "decode batch 16 vs HF",
            "decode/batch16",
            d16.get("ratio"),
            GOAL_DECODE16_VS_HF,
            f">= {GOAL_DECODE16_VS_HF:g}x hf",
            "{:.2f}x",
        )
    if res["e2e"].get("num_requests") == 64:
        add(
            "e2e 64 mixed requests, output tok/s",
            "e2e/batched",
            res["e2e"]["batched"]["jaxkv"]["tok_per_s"],
            GOAL_E2E_TOK_S,
            f">= {GOAL_E2E_TOK_S:g} tok/s",
            "{:.0f} tok/s",
        )
    p256 = res["prefill"].get("tokens256")
    if p256:
        add(
            "prefill 256 vs llama.cpp",
            "prefill/tokens256",
            p256["jaxkv"]["tok_per_s"] / LLAMA_CPP_PREFILL_TOK_S,
            GOAL_PREFILL256_VS_LLAMA_CPP,
            f">= {GOAL_PREFILL256_VS_LLAMA_CPP:g}x llama.cpp "
            f"({GOAL_PREFILL256_VS_LLAMA_CPP * LLAMA_CPP_PREFILL_TOK_S:.0f} tok/s)",
            "{:.2f}x",
        )
    for key, e in res["prefill"].items():
        add(
            f"{_prefill_label(e)} vs HF",
            f"prefill/{key}",
            e.get("ratio"),
            GOAL_PREFILL_VS_HF,
            f">= {GOAL_PREFILL_VS_HF:g}x hf",
            "{:.2f}x",
        )
    return goals


def _prefill_label(e: dict[str, Any]) -> str:
    n = e["prompt_tokens"]
    if e.get("steps", 1) > 1:
        return f"prefill {n} in {e['steps']} chunks of {e['token_budget']}"
    return f"prefill {n}"


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def format_report(res: dict[str, Any]) -> str:
    """The markdown table and the notes under it."""
    goals: dict[str, list[dict]] = {}
    for g in res["goals"]:
        goals.setdefault(g["where"], []).append(g)

    def goal_cells(where):
        gs = goals.get(where, [])
        return (
            "; ".join(g["label"] for g in gs),
            "; ".join(f"{'met' if g['met'] else 'MISSED'} ({g['shown']})" for g in gs),
        )

    rows = [("system", "phase", "batch", "tok/s", "ratio", "goal", "met?")]
    for key, e in res["decode"].items():
        g, m = goal_cells(f"decode/{key}")
        rows.append(
            (
                "jaxkv",
                f"decode (P={e['prompt_tokens']}, N={e['decode_steps']})",
                str(e["batch"]),
                _fmt(e["jaxkv"]["tok_per_s"]),
                _fmt(e.get("ratio"), ".2f") + ("x vs hf" if e.get("ratio") else ""),
                g,
                m,
            )
        )
        for name, v in e.get("variants", {}).items():
            rows.append(
                (
                    f"jaxkv {name}",
                    "decode",
                    str(e["batch"]),
                    _fmt(v["tok_per_s"]),
                    _fmt(v["ratio_vs_jaxkv"], ".2f")
                    + "x vs jaxkv"
                    + (f", {v['ratio']:.2f}x vs hf" if v.get("ratio") else "")
                    + "".join(
                        f", {v['ratio_vs_' + p]:.2f}x vs {p}"
                        for p in PEERS
                        if v.get("ratio_vs_" + p)
                    ),
                    "",
                    "",
                )
            )
        for p in ("hf",) + PEERS:
            if p in e:
                rows.append(
                    (
                        p,
                        "decode",
                        str(e["batch"]),
                        _fmt(e[p]["tok_per_s"]),
                        ""
                        if p == "hf"
                        else _fmt(e.get("ratio_vs_" + p), ".2f") + "x (jaxkv / peer)",
                        "",
                        "",
                    )
                )
    for key, e in res["prefill"].items():
        g, m = goal_cells(f"prefill/{key}")
        rows.append(
            (
                "jaxkv",
                _prefill_label(e),
                "1",
                _fmt(e["jaxkv"]["tok_per_s"]),
                _fmt(e.get("ratio"), ".2f") + ("x vs hf" if e.get("ratio") else ""),
                g,
                m,
            )
        )
        for p in ("hf",) + PEERS:
            if p in e and e.get("steps", 1) == 1:
                rows.append(
                    (
                        p,
                        f"prefill {e['prompt_tokens']}",
                        "1",
                        _fmt(e[p]["tok_per_s"]),
                        ""
                        if p == "hf"
                        else _fmt(e.get("ratio_vs_" + p), ".2f") + "x (jaxkv / peer)",
                        "",
                        "",
                    )
                )
    e2e = res["e2e"]
    n = e2e["num_requests"]
    g, m = goal_cells("e2e/batched")
    rows.append(
        (
            "jaxkv",
            "e2e batched (output tok/s)",
            f"{n} mixed",
            _fmt(e2e["batched"]["jaxkv"]["tok_per_s"]),
            _fmt(e2e["ratio_batched_over_sequential"], ".2f") + "x vs sequential",
            g,
            m,
        )
    )
    rows.append(
        (
            "jaxkv",
            "e2e sequential (output tok/s)",
            f"{n} x 1",
            _fmt(e2e["sequential"]["jaxkv"]["tok_per_s"]),
            "",
            "",
            "",
        )
    )
    if "hf" in e2e["batched"]:
        rows.append(
            (
                "hf",
                "e2e batched generate (output tok/s)",
                f"{n} padded",
                _fmt(e2e["batched"]["hf"]["tok_per_s"]),
                f"jaxkv {_fmt(e2e['batched']['ratio'], '.2f')}x",
                "",
                "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")

    bw = res["bandwidth"]
    meta = res["meta"]
    notes = [
        "",
        f"model {meta['model']}: weights read per decode step "
        f"{res['model']['weight_bytes'] / 1e6:.0f} MB, "
        f"K/V {res['model']['kv_bytes_per_token'] / 1e3:.1f} kB per token",
        f"memory read bandwidth: {bw['read_bytes_per_s'] / 1e9:.2f} GB/s (the best of, over "
        f"{bw['array_bytes'] >> 20} MiB, medians of {bw['repeats']}: numpy sum 1 thread "
        f"{bw['numpy_sum_1thread_bytes_per_s'] / 1e9:.2f}, {bw['threads']} threads "
        f"{bw['numpy_sum_threads_bytes_per_s'] / 1e9:.2f}, BLAS matrix-vector "
        f"{bw['blas_gemv_bytes_per_s'] / 1e9:.2f})",
    ]
    for e in res["decode"].values():
        j = e["jaxkv"]
        notes.append(
            f"decode batch {e['batch']}: {j['step_ms']:.1f} ms per decode step "
            f"({j['engine_calls']} "
            f"engine calls for {j['tokens'] // e['batch']} steps; engine host overhead "
            f"{j['host_overhead_ms_per_step']:.2f} ms/step), {j['bytes_per_s'] / 1e9:.2f} GB/s "
            f"weights+K/V = {100 * j['bandwidth_fraction']:.0f}% of bandwidth; bandwidth limit "
            f"{j['bandwidth_limit_tok_per_s']:.1f} tok/s"
            + (f"; hf {e['hf']['step_ms']:.1f} ms/step" if "hf" in e else "")
        )
    for key, t in res["ttft"].items():
        if key == "e2e_batched":
            j = t["jaxkv"]
            notes.append(
                f"time to first token, e2e batched ({n} requests at once): median "
                f"{j['ms_median']:.0f} ms, p90 {j['ms_p90']:.0f} ms, "
                f"max {j['ms_max']:.0f} ms"
            )
        else:
            length = key.replace("prompt", "").replace("_chunked", "")
            notes.append(
                f"time to first token, {length}-token prompt"
                f"{' in chunks' if key.endswith('_chunked') else ''}: jaxkv "
                f"{t['jaxkv']['ms']:.0f} ms" + (f", hf {t['hf']['ms']:.0f} ms" if "hf" in t else "")
            )
    for mode in ("batched", "sequential"):
        j = e2e[mode]["jaxkv"]
        notes.append(
            f"e2e {mode}: {j['output_tokens']} output + {j['prompt_tokens']} "
            f"prompt tokens "
            f"in {j['seconds']:.1f} s ({j['total_tok_per_s']:.1f} total tok/s, "
            f"{j['runs']} run(s)), {j['engine_calls']} engine calls, host overhead "
            f"{j['host_overhead_ms_per_call']:.1f} ms/call "
            f"({100 * j['host_overhead_s'] / j['seconds']:.0f}%)"
        )
    c = res["compile"]
    notes.append(
        f"compiles: {c['programs']} step programs; {c['xla_compiles']} XLA compiles "
        f"({c['cache_hits']} from the persistent cache), {c['seconds']:.1f} s compiling; "
        f"warm-up {c['warm_up_s']:.0f} s"
    )
    late = {
        f"{ph}/{k}": e["jaxkv"]["new_compiles_in_timed_runs"]
        for ph in ("decode", "prefill")
        for k, e in res[ph].items()
        if e["jaxkv"]["new_compiles_in_timed_runs"]
    }
    late.update(
        {
            f"e2e/{m}": e2e[m]["jaxkv"]["new_compiles_in_timed_runs"]
            for m in ("batched", "sequential")
            if e2e[m]["jaxkv"]["new_compiles_in_timed_runs"]
        }
    )
    if late:
        notes.append(f"WARNING: timed runs compiled new programs: {late}")
    if "hf_threads" in meta:
        th = meta["hf_threads"]
        notes.append(
            f"hf torch threads (faster in a short trial): decode {th['decode']}, "
            f"prefill {th['prefill']}; trial ms {meta['hf_thread_trial_ms']}"
        )
    notes.append(
        f"{meta['date']}, {meta['cpu']} ({meta['cores']} cores), jax {meta['jax']}"
        + (
            f", torch {meta['hf_torch']}, transformers {meta['hf_transformers']}"
            if "hf_torch" in meta
            else ""
        )
        + f"; load average {meta['loadavg_start']} -> {meta['loadavg_end']}; "
        f"medians of {meta['runs']} runs; total {meta['total_s']:.0f} s"
    )
    return "\n".join(lines + notes)
