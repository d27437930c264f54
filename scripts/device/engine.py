"""The engine parts of scripts/device/check.sh, one per process (--part NAME,
[--smoke: tiny shapes, on a CPU], --model GGUF, --out DIR, --budget-s S): each
writes its entry into DIR/device_check.json. --summarize --rc PART=RC ... adds
bench_attention's, writes DIR/device_check.md, exits 0, 2 (a check failed) or 1.

e2e: greedy tokens, attention_backend "pallas" vs "reference" vs Hugging Face
(torch float32, TF32 off, its own process), all on one device; jaxkv under
jax.default_matmul_precision("highest"). Model: the SmolLM2-135M GGUF
(--model, $JAXKV_TEST_GGUF, the jaxkv cache), else "model not found" and a
random model of its shape; smoke: a tiny random Llama, Pallas interpreted.
throughput: 256 seeded mixed requests, Llama-3.2-1B shape, random bf16:
output tok/s, TTFT p50/p99, beside HF generate (bf16, sdpa, batches of 64,
left padded). One row per ENGINE_VARIANTS entry ("unavailable" where
EngineConfig lacks the option).
profile: `device_check_profile.py` (host gap, device idle, HBM fraction,
overlapped scheduling).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # room for torch's process

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.device import results as lib  # noqa: E402
from scripts.device.profile_parts import part_profile, random_llama  # noqa: E402

ENGINE_VARIANTS = [
    ("jaxkv", {"async_scheduling": False}),
    ("jaxkv, async_scheduling", {"async_scheduling": True}),
]
TEXTS = (
    "The capital of France is|def fibonacci(n):|Explain paged attention.|Once upon a time|"
    "The three primary colours are|Write a haiku about caches.|import numpy as np|What is "
    "12 times 7?|The quick brown fox|In 1969, the|List the planets:|SELECT name FROM|A good "
    "cup of tea needs|The mitochondria is|Translate to French: cheese|Rain fell"
).split("|")


def run_requests(eng, prompts, max_tokens):
    """All at once, greedy, no stop; the final RequestOutputs in order."""
    from jaxkv import SamplingParams

    rids = [
        eng.add_request(
            {"prompt_token_ids": p}, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        )
        for p, m in zip(prompts, max_tokens)
    ]
    final = eng.run_to_completion(rids)
    return [final[r] for r in rids]


def compare(a, b):
    first = [
        next(
            (i for i, (u, v) in enumerate(zip(x, y)) if u != v),
            None if len(x) == len(y) else min(len(x), len(y)),
        )
        for x, y in zip(a, b)
    ]
    return dict(
        compared=len(first),
        mismatches=sum(d is not None for d in first),
        per_prompt=[dict(match=d is None, first_diff=d) for d in first],
    )


def part_e2e(a, log):
    import jax

    from checkpoints.jaxkv_format import is_jaxkv_checkpoint
    from jaxkv import LLMEngine

    deadline = time.monotonic() + a.budget_s
    # Smoke: interpreted Pallas costs ~10 s a call at 16 sequences on 2 cores.
    n_prompts, n_tok = (4, 8) if a.smoke else (16, 32)
    small = dict(max_num_batched_tokens=128, max_model_len=64) if a.smoke else {}
    entry = dict(max_tokens=n_tok, matmul_precision=a.matmul_precision)
    path, looked = (None, []) if a.smoke else lib.find_default_model(a.model)
    tmp = tempfile.mkdtemp(prefix="device-check-model-")
    hf = prompts = None
    if path is None:
        shape = lib.TINY_SHAPE if a.smoke else lib.SMOLLM2_SHAPE
        entry["model"] = "tiny random Llama" if a.smoke else "random SmolLM2-135M-shaped stand-in"
        entry["reason"] = None if a.smoke else f"model not found (looked at {', '.join(looked)})"
        prompts = lib.workload(n_prompts, (3, 40), (1, 1), shape["vocab_size"], seed=11)[0]
        hf = lib.run_hf_job(
            dict(kind="greedy", make=shape, save_dir=tmp, prompts=prompts, max_tokens=n_tok),
            a.budget_s,
            log,
        )
        src = tmp
    else:
        entry["model"] = src = str(path)
    tokens = {}
    for backend in ("pallas", "reference"):
        if time.monotonic() > deadline:
            entry[f"{backend}_skipped"] = "time budget spent"
            continue
        with jax.default_matmul_precision(a.matmul_precision):
            eng = LLMEngine.from_pretrained(
                src,
                attention_backend=backend,
                dtype="float32",
                num_pages=16 * 10 + 8,
                max_num_seqs=n_prompts,
                warmup=False,
                **small,
            )
            prompts = prompts or [eng.tokenizer.encode(t) for t in TEXTS[:n_prompts]]
            outs = run_requests(eng, prompts, [n_tok] * len(prompts))
            tokens[backend] = [list(o.outputs[0].token_ids) for o in outs]
        del eng
    if hf is None and is_jaxkv_checkpoint(path):
        entry["hf_skipped"] = "transformers cannot read a jaxkv checkpoint; give --model a GGUF"
    elif hf is None:
        hf = lib.run_hf_job(
            dict(kind="greedy", model=src, prompts=prompts, max_tokens=n_tok),
            max(30.0, deadline - time.monotonic() + 30),
            log,
        )
    shutil.rmtree(tmp, ignore_errors=True)
    if hf is not None:
        tokens["hf"] = hf["tokens"]
        entry["hf"] = {k: hf[k] for k in ("device", "torch", "transformers")}
    cmp = {
        f"{x}_vs_{y}": compare(tokens[x], tokens[y])
        for x, y in (("pallas", "reference"), ("pallas", "hf"), ("reference", "hf"))
        if x in tokens and y in tokens
    }
    ok = bool(cmp) and not sum(c["mismatches"] for c in cmp.values())
    entry.update(
        prompts=len(prompts),
        comparisons=cmp,
        check="pass" if ok else "fail",
        status="ok" if ok else "failed",
        summary=f"{entry['model'].split('/')[-1]}: "
        + ", ".join(
            f"{k} {c['compared'] - c['mismatches']}/{c['compared']} equal" for k, c in cmp.items()
        ),
    )
    return entry


def engine_rows(a, shape, prompts, outs, B, deadline):
    """One row per ENGINE_VARIANTS entry: a warm pass (same lengths, other
    tokens, so every program it needs is compiled), then the timed pass."""
    import jax.numpy as jnp

    from jaxkv import LLMEngine
    from jaxkv.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    model = random_llama(shape, jnp.bfloat16)
    warm = [[(t + 7) % (shape["vocab_size"] - 1) + 1 for t in p] for p in prompts]
    pages = sum(-(-(len(p) + o) // 16) for p, o in zip(prompts, outs)) + 2
    rows = []
    for name, opts in ENGINE_VARIANTS:
        missing = sorted(set(opts) - fields)
        if missing or time.monotonic() > deadline:
            rows.append(
                dict(system=name, error="skipped: time budget spent")
                if not missing
                else dict(
                    system=name, unavailable=f"unavailable: no {missing[0]} option in this version"
                )
            )
            continue
        eng = LLMEngine(
            model,
            None,
            EngineConfig(
                dtype="bfloat16",
                max_num_seqs=B,
                max_num_batched_tokens=64 if a.smoke else 2048,
                num_pages=pages,
                max_model_len=64 if a.smoke else 1024,
                warmup=False,
                **opts,
            ),
        )
        for ps in (warm, prompts):  # the second pass is timed
            st, t0 = dict(eng.runner.stats), time.perf_counter()
            final = run_requests(eng, ps, outs)
            wall = time.perf_counter() - t0
        got = [len(o.outputs[0].token_ids) for o in final]
        if got != outs:
            raise RuntimeError(f"{name}: output lengths {got[:8]}... differ from {outs[:8]}...")
        rows.append(
            lib.rate_row(
                name,
                wall,
                sum(got),
                [o.metrics["first_token"] - o.metrics["arrival"] for o in final],
                requests=len(final),
                runner_calls=eng.runner.stats["calls"] - st["calls"],
                runner_s=eng.runner.stats["seconds"] - st["seconds"],
            )
        )
        del eng
    return rows


def part_throughput(a, log):
    deadline = time.monotonic() + a.budget_s
    shape = lib.TINY_THROUGHPUT_SHAPE if a.smoke else lib.LLAMA_1B_SHAPE
    n, pr, orr, B = (8, (4, 24), (2, 8), 4) if a.smoke else (256, (32, 512), (16, 256), 64)
    prompts, outs = lib.workload(n, pr, orr, shape["vocab_size"], seed=2025)
    rows = engine_rows(a, shape, prompts, outs, B, deadline)
    lib.Results(a.out).update("throughput", dict(status="running", rows=rows))  # if HF hangs
    left = max(20.0, deadline - time.monotonic())
    try:
        hf = lib.run_hf_job(
            dict(
                kind="generate",
                shape=shape,
                dtype="bfloat16",
                attn="sdpa",
                prompts=prompts,
                outputs=outs,
                batch=B,
                budget_s=left,
            ),
            left + 90,
            log,
        )
        rows.append(
            lib.rate_row(
                f"HF transformers generate (bf16, sdpa, batch {B})",
                hf["wall_s"],
                hf["output_tokens"],
                hf["ttft_s"],
                partial=hf["requests"] < n,
                **{
                    k: hf[k]
                    for k in ("requests", "computed_tokens", "device", "torch", "transformers")
                },
            )
        )
    except Exception:
        rows.append(dict(system="HF transformers generate", error=traceback.format_exc()[-2000:]))
    for r in rows[:-1]:
        if rows[-1].get("output_tok_s") and r.get("output_tok_s"):
            r["ratio_vs_hf"] = r["output_tok_s"] / rows[-1]["output_tok_s"]
    done = [r for r in rows if r.get("output_tok_s")]
    err = next((r["error"] for r in rows if r.get("error")), None if done else "nothing measured")
    return dict(
        rows=rows,
        requests=n,
        prompt_range=pr,
        output_range=orr,
        error=err,
        status="failed" if err else "ok",
        model="tiny random Llama" if a.smoke else "Llama-3.2-1B shape, random bf16",
        summary="; ".join(
            f"{r['system'].split(' (')[0]} {r['output_tok_s']:.1f} tok/s" for r in done
        ),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("e2e", "throughput", "profile"))
    ap.add_argument("--summarize", action="store_true", help="with --rc PART=RC ...")
    ap.add_argument("--rc", nargs="*", default=[])
    ap.add_argument("--out", default=os.environ.get("OUT") or "device_out")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU)")
    ap.add_argument("--model", help="the default model's GGUF file (or HF folder)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=60.0,
        help="start no new work in this part after this many seconds",
    )
    ap.add_argument("--matmul-precision", default="highest")
    a = ap.parse_args(argv)
    if not (a.summarize or a.part):
        ap.error("--part or --summarize")
    import jax

    dev, res = jax.devices()[0], lib.Results(a.out)
    meta = dict(
        mode="smoke" if a.smoke else "full",
        jax=jax.__version__,
        python=platform.python_version(),
        device=f"{dev.platform}: {getattr(dev, 'device_kind', '?')}",
    )
    if a.summarize:  # the meta too where no engine part ran (--parts attention)
        have = res.load().get("meta", {})
        res.update(**{k: v for k, v in meta.items() if k not in have})
        return lib.summarize(a.out, a.rc)
    res.update(a.part, dict(status="running"), **meta)
    t0 = time.monotonic()
    try:
        entry = dict(e2e=part_e2e, throughput=part_throughput, profile=part_profile)[a.part](
            a, sys.stdout
        )
    except Exception:
        traceback.print_exc()
        entry = dict(status="failed", error=traceback.format_exc()[-4000:])
    entry = dict(entry, status=entry.get("status") or "ok", wall_s=round(time.monotonic() - t0, 2))
    res.update(a.part, entry)
    print(
        f"[device_check] {a.part}: {entry['status']} in {entry['wall_s']}s "
        f"{entry.get('summary', '')}",
        flush=True,
    )
    return 2 if entry.get("check") == "fail" else (1 if entry["status"] == "failed" else 0)


if __name__ == "__main__":
    sys.exit(main())
