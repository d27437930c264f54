"""Quality of reduced-precision KV caches and weights on the default model:
greedy agreement over 16 chat prompts x 64 tokens against a baseline (whole
outputs identical, the agreeing prefix, and the share of positions where the
next token is the same given the baseline's prefix), and the mean
log-likelihood of a fixed text.

    python scripts/bench/quality.py [--model M] [--prompts 16] [--tokens 64]
                              [--what kv] [--kv float32,bfloat16,int8,int4,fp8]

KV formats are compared with the bfloat16 cache (and int8 with float32).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.quality_parts import (
    agreement,
    greedy_outputs,
    mean_loglik,
    teacher_forced_agreement,
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--what",
        choices=["kv", "weights"],
        default="kv",
        help="kv: float32 / bfloat16 / int8 KV caches; weights: float32 / int8 / "
        "w8a8 weights (default: %(default)s)",
    )
    ap.add_argument(
        "--kv",
        default="float32,bfloat16,int8,int4,fp8,fp8_e5m2",
        help="KV dtypes for --what kv, comma-separated (default: %(default)s)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    from checkpoints import load_checkpoint
    from checkpoints.known_models import resolve_model_path
    from jaxkv.model.llama import Llama

    config, params, tok = load_checkpoint(resolve_model_path(a.model))
    t0 = time.perf_counter()
    if a.what == "kv":
        model = Llama.from_params(config, params)
        kvs = a.kv.split(",")
        runs = {kv: greedy_outputs(model, tok, a.prompts, a.tokens, kv_dtype=kv) for kv in kvs}
        ll = {kv: mean_loglik(model, tok, kv) for kv in runs}
        base = "bfloat16" if "bfloat16" in kvs else kvs[0]
        pairs = [(kv, base) for kv in kvs if kv != base]
        if "int8" in kvs and "float32" in kvs and base != "float32":
            pairs.append(("int8", "float32"))

        def forced(x, y):
            return teacher_forced_agreement(model, tok, runs[y], kv_dtype=x)
    else:
        models = {
            q or "float32": Llama.from_params(config, params, quantize=q)
            for q in (None, "int8", "w8a8")
        }
        # 16 sequences per step, as a batched run decodes.
        runs = {
            k: greedy_outputs(m, tok, a.prompts, a.tokens, max_num_seqs=16)
            for k, m in models.items()
        }
        ll = {k: mean_loglik(m, tok) for k, m in models.items()}
        pairs = (("int8", "float32"), ("w8a8", "float32"))

        def forced(x, y):
            return teacher_forced_agreement(models[x], tok, runs[y])

    from scripts.bench.common import _cpu_name

    res = {
        "what": a.what,
        "model": a.model,
        "prompts": a.prompts,
        "tokens": a.tokens,
        "cpu": _cpu_name(),
        "mean_loglik": ll,
        "agreement": {},
    }
    print(
        f"| {'KV cache' if a.what == 'kv' else 'weights'} | vs | identical outputs | "
        "mean agreeing prefix | same next token, same prefix | mean log-lik | delta |"
    )
    print("|---|---|---|---|---|---|---|")
    for x, y in pairs:
        same, prefix = agreement(runs[x], runs[y])
        tf = forced(x, y)
        res["agreement"][f"{x}_vs_{y}"] = {
            "identical": same,
            "prefix": prefix,
            "teacher_forced": tf,
        }
        print(
            f"| {x} | {y} | {same}/{a.prompts} | {prefix:.3f} | {tf:.4f} | {ll[x]:.4f} | "
            f"{ll[x] - ll[y]:+.4f} |"
        )
    print(f"({time.perf_counter() - t0:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
