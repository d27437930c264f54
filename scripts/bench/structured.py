"""What structured outputs cost: decode tok/s of 16 sequences, none under a
grammar versus 8 of them under a JSON schema, side by side in one run
(medians of several runs), and the host time spent building the grammar
masks per step.

    python scripts/bench/structured.py [--model M] [--runs 3] [--json out.json]

Sequences with token rules run one decode step per call (the next mask
depends on the token just sampled), so a batch with any of them loses the
multi-step decode; the table shows both effects together, as a user sees
them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

ROOT = Path(__file__).resolve().parents[2]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}},
    },
    "required": ["name", "age", "tags"],
}


def run(engine, SamplingParams, prompt, constrained: int, max_tokens: int, seed: int) -> dict:
    import jaxkv.core.plan_builder as step_plan

    spent = [0.0]
    real = step_plan._rules

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    step_plan._rules = timed
    try:
        ids = []
        for i in range(16):
            so = {"json": SCHEMA} if i < constrained else None
            # The constrained ones stop when their JSON is complete; the rest
            # run their max_tokens.
            ids.append(
                engine.add_request(
                    prompt,
                    SamplingParams(
                        max_tokens=max_tokens,
                        temperature=1.0,
                        seed=seed * 100 + i,
                        ignore_eos=so is None,
                        structured_outputs=so,
                    ),
                )
            )
        steps0 = engine.stats["steps"]
        t = time.perf_counter()
        outs = engine.run_to_completion(ids)
        wall = time.perf_counter() - t
    finally:
        step_plan._rules = real
    tokens = sum(len(o.outputs[0].token_ids) for o in outs.values())
    steps = engine.stats["steps"] - steps0
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "wall_s": wall,
        "steps": steps,
        "mask_ms_per_step": 1000 * spent[0] / max(steps, 1),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    from jaxkv import LLM, SamplingParams

    llm = LLM(a.model, max_num_seqs=16)
    eng, tok = llm.engine, llm.tokenizer
    prompt = {
        "prompt_token_ids": tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": "Describe a person as JSON."}],
                add_generation_prompt=True,
            ),
            add_special_tokens=False,
        )
    }
    for c in (0, 8):  # warm: compile what each mix runs
        run(eng, SamplingParams, prompt, c, 8, seed=99)
    rows = {0: [], 8: []}
    for r in range(a.runs):
        for c in (0, 8):
            rows[c].append(run(eng, SamplingParams, prompt, c, a.max_tokens, seed=r))
            print(
                f"bench_structured: run {r + 1}/{a.runs}, {c} under a schema: "
                f"{rows[c][-1]['tok_s']:.1f} tok/s",
                file=sys.stderr,
            )
    med = {c: {k: statistics.median(x[k] for x in v) for k in v[0]} for c, v in rows.items()}
    print("| 16 sequences | decode tok/s | steps | grammar masks (host ms / step) |")
    print("|---|---:|---:|---:|")
    for c, label in ((0, "none under a grammar"), (8, "8 under a JSON schema")):
        m = med[c]
        print(f"| {label} | {m['tok_s']:.1f} | {m['steps']:.0f} | {m['mask_ms_per_step']:.2f} |")
    print(
        f"ratio: {med[8]['tok_s'] / med[0]['tok_s']:.2f}x; medians of {a.runs} runs, "
        f"max_tokens {a.max_tokens}, temperature 1"
    )
    if a.json:
        a.json.write_text(json.dumps({"median": med, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
