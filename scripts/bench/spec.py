"""Speculative decoding, side by side with plain decoding in one run.

    python scripts/bench/spec.py [--model smollm2-135m-instruct] [--runs 3]
        [--max-tokens 128] [--k 4] [--draft-sweep] [--eagle HEAD_DIR] [--json out.json]

Batch-1 decode tok/s (output tokens after the first, over the time from
the first token to the last; chat template, greedy) of each task with
speculation off and with n-gram prompt lookup, runs interleaved, medians of
`--runs`: input-grounded tasks (rewrite, fix, edit a given passage, a code
edit), where the answer copies spans of the prompt, and open-ended chat,
where it does not. Then 16 sequences at once (all tasks, output tok/s over
the whole run). Greedy outputs are compared between the two (they must be
the same tokens). `--draft-sweep`: the draft-model proposer at batch 1 with
drafts of the target's width and 1 to 30 layers: random weights (acceptance
near 0, so a step costs what it costs) and the target itself (acceptance
1): step time, and the mean accepted length a draft of that size needs to
break even with plain decoding. `--eagle HEAD_DIR`: an EAGLE-3 head (from
`jaxkv train-draft`) against plain and n-gram on held-out open chat
(`scripts/bench/spec_eagle.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.common import TEXT, _cpu_name, _num_cores

CODE = """def total_price(items, tax):
    result = 0
    for item in items:
        result = result + item["price"] * item["quantity"]
    result = result + result * tax
    return result


def cheapest(items):
    best = None
    for item in items:
        if best is None or item["price"] < best["price"]:
            best = item
    return best
"""

PASSAGE = TEXT[:700]
TASKS = {  # name: (grounded?, user message)
    "rewrite": (
        True,
        "Rewrite the following text in the present tense. Reply with the "
        "rewritten text only.\n\n" + PASSAGE,
    ),
    "edit": (
        True,
        "In the following text, replace the word 'harbour' with 'port'. Reply "
        "with the full edited text only.\n\n" + PASSAGE,
    ),
    "fix": (
        True,
        "Correct the spelling mistakes in the following text. Reply with the "
        "corrected text only.\n\n" + PASSAGE.replace("the ", "teh ").replace("and ", "adn "),
    ),
    "summarize": (True, "Summarize the following text in three sentences.\n\n" + PASSAGE),
    "code_edit": (
        True,
        "Rename the variable `result` to `total` in the following Python "
        "code. Reply with the full updated code only.\n\n" + CODE,
    ),
    "chat_story": (False, "Write a short story about a robot who learns to paint."),
    "chat_explain": (False, "Explain why the sky is blue to a ten year old."),
    "chat_advice": (False, "Give me five tips for staying focused while studying."),
}


def chat_ids(tok, text: str) -> list[int]:
    t = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tok.encode(t, add_special_tokens=False)


def make_engine(module, tok, spec, draft=None, **kw):
    from jaxkv import LLMEngine
    from jaxkv.config import EngineConfig

    cfg = dict(
        num_pages=1200,
        page_size=16,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        warmup=False,
        speculative_config=spec,
    )
    cfg.update(kw)
    return LLMEngine(module, tok, EngineConfig(**cfg), draft_model=draft)


def run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Greedy outputs of `prompts` submitted together: tokens, decode tok/s
    per request (after the first token), output tok/s of the whole run."""
    from jaxkv import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    final = engine.run_to_completion(ids)
    wall = time.perf_counter() - t0
    outs = [final[i] for i in ids]
    rates = []
    for o in outs:
        n = len(o.outputs[0].token_ids)
        span = o.metrics["finish"] - o.metrics["first_token"]
        rates.append((n - 1) / span if n > 1 and span > 0 else float("nan"))
    return dict(
        tokens=[o.outputs[0].token_ids for o in outs],
        decode_tok_s=rates,
        output_tok_s=sum(len(t.outputs[0].token_ids) for t in outs) / wall,
        spec=engine.speculative_metrics(),
    )


def median(xs):
    return float(statistics.median(xs))


def bench_ngram(module, tok, a) -> dict:
    spec = {
        "method": "ngram",
        "num_speculative_tokens": a.k,
        "adaptive": a.adaptive,
        "prompt_lookup_max": a.lookup_max,
        "prompt_lookup_min": a.lookup_min,
    }
    engines = {"plain": make_engine(module, tok, None), "ngram": make_engine(module, tok, spec)}
    prompts = {name: chat_ids(tok, text) for name, (_, text) in TASKS.items()}
    for eng in engines.values():  # compile what the timed runs use
        for p in prompts.values():
            run(eng, [p], 16)
        run(eng, list(prompts.values()), 16)
    rows = {name: {c: [] for c in engines} for name in TASKS}
    same, acc = {}, {name: None for name in TASKS}
    for _ in range(a.runs):
        for name, p in prompts.items():
            for c, eng in engines.items():
                before = dict(eng.spec_stats.as_dict()) if c == "ngram" else None
                r = run(eng, [p], a.max_tokens)
                rows[name][c].append(r["decode_tok_s"][0])
                same.setdefault(name, {})[c] = r["tokens"][0]
                if before is not None:
                    now = eng.spec_stats.as_dict()
                    d = now["drafts"] - before["drafts"]
                    acc[name] = dict(
                        proposed=now["proposed"] - before["proposed"],
                        accepted=now["accepted"] - before["accepted"],
                        mean_accepted_length=1 + (now["accepted"] - before["accepted"]) / d
                        if d
                        else 1.0,
                    )
            print(
                f"  {name}: " + ", ".join(f"{c} {rows[name][c][-1]:.1f}" for c in engines),
                file=sys.stderr,
                flush=True,
            )
    batched = {c: [] for c in engines}
    many = [prompts[n] for n in TASKS] * 3
    many = (many + many)[:16]
    for _ in range(a.runs):
        for c, eng in engines.items():
            batched[c].append(run(eng, many, a.max_tokens)["output_tok_s"])
    out = dict(tasks={}, batched={c: median(v) for c, v in batched.items()})
    for name, (grounded, _) in TASKS.items():
        p, s = median(rows[name]["plain"]), median(rows[name]["ngram"])
        out["tasks"][name] = dict(
            grounded=grounded,
            plain=p,
            ngram=s,
            speedup=s / p,
            identical=same[name]["plain"] == same[name]["ngram"],
            tokens=len(same[name]["plain"]),
            **(acc[name] or {}),
        )
    out["batched"]["speedup"] = out["batched"]["ngram"] / out["batched"]["plain"]
    return out


def bench_draft_sweep(module, tok, a) -> dict:
    from jaxkv.model.llama import Llama

    prompt = chat_ids(tok, TASKS["chat_explain"][1])
    plain = make_engine(module, tok, None)
    run(plain, [prompt], 8)
    base = median([run(plain, [prompt], a.max_tokens)["decode_tok_s"][0] for _ in range(a.runs)])
    out = dict(plain=base, drafts=[])
    cfg = module.config
    for layers in a.draft_layers:
        draft = (
            module
            if layers == cfg.num_layers
            else Llama.random_init(dataclasses.replace(cfg, num_layers=layers), seed=0)
        )
        spec = {
            "method": "draft_model",
            "model": "sweep",
            "num_speculative_tokens": a.k,
            "adaptive": False,
        }
        eng = make_engine(module, tok, spec, draft=draft)
        run(eng, [prompt], 8)
        rates, m = [], None
        for _ in range(a.runs):
            r = run(eng, [prompt], a.max_tokens)
            rates.append(r["decode_tok_s"][0])
            m = r["spec"]
        rate = median(rates)
        mal = m["mean_accepted_length"] or 1.0
        step = mal / rate  # seconds per verify step (one draft pass + one target pass)
        out["drafts"].append(
            dict(
                layers=layers,
                self=draft is module,
                tok_s=rate,
                mean_accepted_length=mal,
                step_seconds=step,
                break_even_length=step * base,
                propose_share=m["propose_share"],
            )
        )
        print(
            f"  draft {layers} layers: {rate:.1f} tok/s, accepted length {mal:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return out


def report(res: dict) -> str:
    lines = [
        f"jaxkv speculative decoding, {res['date']}, {res['cpu']} ({res['cores']} cores), "
        f"weights {res['quantize'] or 'float32'}, k={res['k']}, {res['runs']} runs, "
        f"max_tokens {res['max_tokens']}"
    ]
    if "ngram" in res:
        lines += [
            "",
            "| task | grounded | plain tok/s | n-gram tok/s | speedup "
            "| mean accepted length | identical |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for name, t in res["ngram"]["tasks"].items():
            lines.append(
                f"| {name} | {'yes' if t['grounded'] else 'no'} | {t['plain']:.1f} | "
                f"{t['ngram']:.1f} | {t['speedup']:.2f}x | "
                f"{t.get('mean_accepted_length', 1):.2f} | {t['identical']} |"
            )
        b = res["ngram"]["batched"]
        lines.append(
            f"| 16 sequences (output tok/s) | mixed | {b['plain']:.1f} | "
            f"{b['ngram']:.1f} | {b['speedup']:.2f}x | | |"
        )
    if "draft_sweep" in res:
        d = res["draft_sweep"]
        lines += [
            "",
            f"draft model at batch 1 (plain {d['plain']:.1f} tok/s)",
            "",
            "| draft layers | weights | tok/s | mean accepted length | step ms "
            "| break-even accepted length | proposer share |",
            "|---:|---|---:|---:|---:|---:|---:|",
        ]
        for r in d["drafts"]:
            lines.append(
                f"| {r['layers']} | {'target' if r['self'] else 'random'} | "
                f"{r['tok_s']:.1f} | {r['mean_accepted_length']:.2f} | "
                f"{1000 * r['step_seconds']:.0f} | {r['break_even_length']:.2f} | "
                f"{r['propose_share']:.0%} |"
            )
    if "eagle3" in res:
        from scripts.bench.spec_eagle import report_eagle

        lines += report_eagle(res["eagle3"], res["k"])
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="speculative_config's adaptive gate",
    )
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--lookup-min", type=int, default=2)
    p.add_argument(
        "--quantize",
        default=None,
        choices=("int8", "w8a8", "float32", "gguf-blocks"),
        help="weights as the engine's --quantize (default: the engine's, a GGUF's weights "
        "kept in their blocks on CPU; float32: every weight dequantized)",
    )
    p.add_argument("--draft-sweep", action="store_true")
    p.add_argument("--draft-layers", type=int, nargs="+", default=[1, 4, 8, 30])
    p.add_argument(
        "--eagle",
        default=None,
        metavar="HEAD_DIR",
        help="an EAGLE-3 head: its figures on held-out open chat",
    )
    p.add_argument("--tasks", action="store_true", help="with --eagle: the n-gram task table too")
    p.add_argument(
        "--eagle-prompts",
        type=int,
        default=8,
        help="held-out prompts the head runs on (default: %(default)s)",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    from checkpoints.loader import load_model
    from jaxkv.paths import enable_compilation_cache

    enable_compilation_cache()
    from checkpoints.known_models import ships_as_gguf
    from jaxkv.config import EngineConfig
    from jaxkv.model.blocks import keep_gguf_blocks

    quantize = None if a.quantize in ("float32", "gguf-blocks") else a.quantize
    blocks = {"gguf-blocks": True, "float32": False}.get(a.quantize)
    if blocks is None:  # the engine's default for this model and machine
        blocks = keep_gguf_blocks(EngineConfig(quantize=quantize), ships_as_gguf(a.model))
    module, tok = load_model(a.model, quantize=quantize, gguf_blocks=blocks)
    res = dict(
        date=time.strftime("%Y-%m-%d"),
        cpu=_cpu_name(),
        cores=_num_cores(),
        k=a.k,
        runs=a.runs,
        max_tokens=a.max_tokens,
        model=a.model,
        quantize=a.quantize or ("gguf-blocks" if blocks else "float32"),
    )
    if a.eagle:  # first: the head's figures are what this run is for
        from scripts.bench.spec_eagle import bench_eagle

        res["eagle3"] = bench_eagle(module, tok, a, make_engine, run, chat_ids)
    if not a.eagle or a.tasks:
        res["ngram"] = bench_ngram(module, tok, a)
    if a.draft_sweep:
        res["draft_sweep"] = bench_draft_sweep(module, tok, a)
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
