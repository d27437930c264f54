"""Importance eviction on a retrieval task: secret-word retrieval (a pass-key task) on the
default model (SmolLM2-135M-Instruct) with the full cache, and with KV
budgets of 12.5%, 25% and 50% of the prompt's tokens under snapkv, h2o and
streaming (4 sink tokens plus a recent window).

    python scripts/bench/eviction.py [--samples 40] [--filler 20]

The log-likelihood: the first --context tokens of a long text (CPython's
LICENSE.txt) as the prompt, the next --continuation tokens forced as the
answer by a regex; nats per token at the same budget fractions of the
context.

Each sample states a secret word (one of 40 common nouns) at a random
depth of a filler text (about --filler x 26 tokens) and asks for it at
the end; it is solved when the greedy answer's first word is the key. Every engine runs every
sample (fixed seed), so the methods answer the same prompts. Writes
scripts/results/bench_eviction_cpu_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

ROOT = Path(__file__).resolve().parents[2]

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


WORDS = (
    "apple",
    "river",
    "garden",
    "silver",
    "tiger",
    "window",
    "candle",
    "forest",
    "rocket",
    "pencil",
    "mountain",
    "ocean",
    "violin",
    "dragon",
    "castle",
    "pepper",
    "island",
    "jacket",
    "ladder",
    "mirror",
    "orange",
    "planet",
    "rabbit",
    "saddle",
    "tomato",
    "wallet",
    "zebra",
    "anchor",
    "basket",
    "cactus",
    "donkey",
    "engine",
    "falcon",
    "guitar",
    "hammer",
    "igloo",
    "jungle",
    "kettle",
    "lemon",
    "magnet",
)


def samples(n: int, filler: int, seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, key) pairs: a secret word stated at a random depth of the
    filler, asked for at the end."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        key = str(rng.choice(WORDS))
        at = int(rng.integers(0, filler))
        parts = [FILLER] * filler
        parts.insert(at, f"The secret word is {key}. Remember it: {key}.")
        prompt = (
            "There is an important piece of information hidden inside a lot of "
            "irrelevant text. Find it and memorize it.\n"
            + " ".join(parts)
            + "\nWhat is the secret word? The secret word is"
        )
        out.append((prompt, key))
    return out


def engine(model: str, variant: str, budget: int | None, page_size: int, **kw):
    """An engine of `model` with `variant`'s eviction ("full": none) at `budget`."""
    from jaxkv.core.engine import LLMEngine

    kw.update(
        page_size=page_size, max_num_batched_tokens=512, enable_prefix_caching=False, warmup=False
    )
    if variant in ("snapkv", "h2o"):
        kw.update(kv_eviction=variant, kv_budget=budget, snapkv_window=min(32, budget // 2))
    elif variant == "streaming":
        kw.update(kv_eviction="streaming", num_sink_tokens=4, streaming_window=budget - 4)
    return LLMEngine.from_pretrained(model, **kw)


def run(model: str, variant: str, budget: int | None, data, page_size: int) -> dict:
    from jaxkv.core.sampling_params import SamplingParams

    eng = engine(model, variant, budget, page_size, max_num_seqs=8, max_model_len=2048)
    params = SamplingParams(max_tokens=8, temperature=0)
    t0 = time.perf_counter()
    ids = [eng.add_request(p, params) for p, _ in data]
    out = eng.run_to_completion(ids)
    secs = time.perf_counter() - t0
    answers = [out[i].outputs[0].text for i in ids]
    solved = [re.findall(r"[a-z]+", a.lower())[:1] == [key] for a, (_, key) in zip(answers, data)]
    return dict(
        solved=float(np.mean(solved)), seconds=secs, answers=answers[:5], metrics=eng.kv_metrics()
    )


def long_text() -> str:
    """A long English text every CPython install has: its LICENSE (the
    history of the software and the licence terms)."""
    import os
    import sysconfig

    for d in (
        sysconfig.get_paths()["stdlib"],
        os.path.join(sys.base_prefix, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}"),
    ):
        path = Path(d) / "LICENSE.txt"
        if path.exists():
            return path.read_text()
    raise FileNotFoundError("LICENSE.txt of this Python")


def likelihood(
    model: str, variant: str, budget: int | None, context: str, cont: str, page_size: int
) -> dict:
    """Nats per token of `cont` after `context`, the answer forced to
    `cont` by a regex (the log-probabilities reported are the model's own,
    before the token rules), with `variant`'s eviction at `budget`."""
    from jaxkv.core.sampling_params import SamplingParams

    eng = engine(model, variant, budget, page_size, max_num_seqs=1, max_model_len=4096)
    params = SamplingParams(
        max_tokens=2 * len(cont),
        temperature=0,
        logprobs=0,
        structured_outputs={"regex": re.escape(cont)},
    )
    rid = eng.add_request(context, params)
    o = eng.run_to_completion([rid])[rid].outputs[0]
    if o.text != cont:
        raise RuntimeError(f"{variant}: the forced answer drifted: {o.text[:80]!r}")
    lps = [lp.logprob for lp in o.logprobs]
    return dict(nats_per_token=-float(np.sum(lps)) / len(lps), tokens=len(lps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--filler", type=int, default=20)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024, help="tokens of the long text read")
    ap.add_argument("--continuation", type=int, default=128, help="tokens of it scored")
    ap.add_argument("--fractions", default="0.125,0.25,0.5")
    ap.add_argument("--variants", default="snapkv,h2o,streaming")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from checkpoints.loader import load_model
    from scripts.bench.common import _cpu_name, _loadavg, _num_cores

    data = samples(args.samples, args.filler)
    _, tok = load_model(args.model)
    lengths = [len(tok.encode(p)) for p, _ in data]
    mean_len = float(np.mean(lengths))
    print(f"{len(data)} prompts of {min(lengths)}-{max(lengths)} tokens (mean {mean_len:.0f})")
    ids = tok.encode(long_text())
    ctx_ids, cont_ids = ids[: args.context], ids[args.context : args.context + args.continuation]
    context, cont = tok.decode(ctx_ids), tok.decode(cont_ids)
    table = {"full": run(args.model, "full", None, data, args.page_size)}
    table["full"]["ll"] = likelihood(args.model, "full", None, context, cont, args.page_size)
    print(
        f"full cache: {table['full']['solved']:.1%}; text "
        f"{table['full']['ll']['nats_per_token']:.4f} nats/token",
        flush=True,
    )
    for frac in [float(f) for f in args.fractions.split(",")]:
        budget = max(
            2 * args.page_size, int(round(frac * mean_len / args.page_size)) * args.page_size
        )
        for v in args.variants.split(","):
            res = run(args.model, v, budget, data, args.page_size)
            res["budget"] = budget
            res["ll_budget"] = lb = max(
                2 * args.page_size,
                int(round(frac * args.context / args.page_size)) * args.page_size,
            )
            res["ll"] = likelihood(args.model, v, lb, context, cont, args.page_size)
            table[f"{v}@{frac}"] = res
            print(
                f"{v:10s} budget {frac:5.1%} ({budget} tokens): {res['solved']:.1%} "
                f"({res['seconds']:.0f} s); text {res['ll']['nats_per_token']:.4f} nats/token "
                f"at {lb} of {args.context} tokens",
                flush=True,
            )
    out = (
        Path(args.out)
        if args.out
        else (
            ROOT
            / "scripts"
            / "results"
            / f"bench_eviction_cpu_{datetime.date.today().isoformat()}.json"
        )
    )
    out.write_text(
        json.dumps(
            dict(
                command=" ".join(sys.argv),
                cpu=_cpu_name(),
                cores=_num_cores(),
                loadavg=_loadavg(),
                prompt_tokens=dict(min=min(lengths), max=max(lengths), mean=mean_len),
                table=table,
            ),
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
