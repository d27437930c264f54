"""The EAGLE-3 part of `scripts/bench/spec.py --eagle HEAD_DIR`: on held-out
open-chat prompts (data/draft_prompts/heldout.jsonl, which the head never
trained on), batch-1 decode tok/s of plain decoding, n-gram lookup and the
head (with the adaptive gate as given, and always speculating, whose run
gives the acceptance), runs interleaved, medians of `--runs`; then 16
sequences at once. Each method's greedy tokens are compared with plain
decoding's. The step costs: plain ms per token, and per verify step of the
head (its mean accepted length over its tok/s), with the share of time the
head's own calls take."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HELD_OUT = Path(__file__).resolve().parents[2] / "data" / "draft_prompts" / "heldout.jsonl"


def held_out_prompts(n: int) -> list[str]:
    lines = [json.loads(x)["prompt"] for x in HELD_OUT.read_text().splitlines() if x.strip()]
    return lines[:n]


def bench_eagle(module, tok, a, make_engine, run, chat_ids) -> dict:
    k = a.k
    specs = {
        "plain": None,
        "ngram": {
            "method": "ngram",
            "num_speculative_tokens": k,
            "adaptive": a.adaptive,
            "prompt_lookup_max": a.lookup_max,
            "prompt_lookup_min": a.lookup_min,
        },
        "eagle3": {
            "method": "eagle3",
            "model": a.eagle,
            "num_speculative_tokens": k,
            "adaptive": a.adaptive,
        },
        "eagle3_always": {
            "method": "eagle3",
            "model": a.eagle,
            "num_speculative_tokens": k,
            "adaptive": False,
        },
    }
    engines = {c: make_engine(module, tok, s) for c, s in specs.items()}
    prompts = [chat_ids(tok, t) for t in held_out_prompts(a.eagle_prompts)]
    many = (prompts * 16)[:16]
    for eng in engines.values():  # compile what the timed runs use: one untimed pass of
        for p in prompts:  # each (the 16 sequences pass through every bucket as they finish)
            run(eng, [p], a.max_tokens)
        run(eng, many, a.max_tokens)
    compiled = {c: eng._num_programs() for c, eng in engines.items()}
    before = {c: eng.speculative_metrics() for c, eng in engines.items()}
    rates = {c: [[] for _ in prompts] for c in engines}
    tokens = {c: [None] * len(prompts) for c in engines}
    spec = {c: {} for c in engines}
    for _ in range(a.runs):
        for i, p in enumerate(prompts):
            for c, eng in engines.items():
                r = run(eng, [p], a.max_tokens)
                rates[c][i].append(r["decode_tok_s"][0])
                tokens[c][i] = r["tokens"][0]
        print(
            "  eagle3 batch 1: "
            + ", ".join(f"{c} {statistics.median([x[-1] for x in rates[c]]):.1f}" for c in engines),
            file=sys.stderr,
            flush=True,
        )
    for c, eng in engines.items():  # the batch-1 runs' own figures
        spec[c] = since(before[c], eng.speculative_metrics())
    batched = {c: [] for c in engines}
    for _ in range(a.runs):
        for c, eng in engines.items():
            batched[c].append(run(eng, many, a.max_tokens)["output_tok_s"])
    # programs compiled inside the timed runs (the adaptive gate may choose a shape the
    # warm-up did not): their seconds are in that run's figure
    out = {
        "prompts": len(prompts),
        "batch1": {},
        "batched": {},
        "spec": spec,
        "compiled_while_timed": {
            c: eng._num_programs() - compiled[c] for c, eng in engines.items()
        },
    }
    for c in engines:
        per_prompt = [statistics.median(x) for x in rates[c]]
        out["batch1"][c] = dict(
            tok_s=statistics.median(per_prompt), identical=tokens[c] == tokens["plain"]
        )
        out["batched"][c] = statistics.median(batched[c])
    base = out["batch1"]["plain"]["tok_s"]
    always = spec["eagle3_always"]
    mal = always.get("mean_accepted_length") or 1.0
    rate = out["batch1"]["eagle3_always"]["tok_s"]
    out["costs"] = dict(
        plain_ms_per_token=1000 / base,
        verify_step_ms=1000 * mal / rate,
        mean_accepted_length=mal,
        break_even_length=mal / rate * base,
        head_share=always.get("propose_share", 0.0),
    )
    return out


def since(before: dict, after: dict) -> dict:
    """Speculation figures of the runs between two `speculative_metrics()`."""
    if not after:
        return {}
    d = {
        k: after[k] - before.get(k, 0)
        for k in ("steps", "drafts", "proposed", "accepted", "propose_seconds")
    }
    d["acceptance_rate"] = d["accepted"] / d["proposed"] if d["proposed"] else 0.0
    d["mean_accepted_length"] = 1 + d["accepted"] / d["drafts"] if d["drafts"] else 0.0
    d["propose_share"] = after.get("propose_share", 0.0)
    return d


def report_eagle(e: dict, k: int) -> list[str]:
    b1, bt = e["batch1"], e["batched"]
    base, base16 = b1["plain"]["tok_s"], bt["plain"]
    lines = [
        "",
        f"EAGLE-3 head on {e['prompts']} held-out open-chat prompts (k={k})",
        "",
        "| method | batch 1 tok/s | vs plain | mean accepted length | 16 seqs output tok/s "
        "| vs plain | identical |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for c in b1:
        m = e["spec"][c].get("mean_accepted_length") if e["spec"][c].get("steps") else None
        lines.append(
            f"| {c} | {b1[c]['tok_s']:.1f} | {b1[c]['tok_s'] / base:.2f}x | "
            f"{'' if m is None else f'{m:.2f}'} | {bt[c]:.1f} | {bt[c] / base16:.2f}x "
            f"| {b1[c]['identical']} |"
        )
    late = {c: n for c, n in e.get("compiled_while_timed", {}).items() if n}
    if late:
        lines += [
            "",
            "programs compiled inside timed runs (their time is in the figures): "
            + ", ".join(f"{c} {n}" for c, n in late.items()),
        ]
    c = e["costs"]
    lines += [
        "",
        f"step costs: plain {c['plain_ms_per_token']:.1f} ms per token; a verify step "
        f"of the head {c['verify_step_ms']:.1f} ms (head calls "
        f"{c['head_share']:.0%} of step time), which breaks even at a mean "
        f"accepted length of {c['break_even_length']:.2f} (measured "
        f"{c['mean_accepted_length']:.2f})",
    ]
    return lines
