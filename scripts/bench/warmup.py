"""Warm-up of an engine: how many step programs it compiles at start and how
long that takes (cold: JAX's persistent compilation cache off), then a run
of mixed requests counting the XLA compiles left after warm-up (the goal is
none).

    python scripts/bench/warmup.py [--model M] [--requests 200] [--json out.json]
                                   [engine options as LLMEngine keywords, e.g. max_num_seqs=16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=24, help="most output tokens per request")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("options", nargs="*", help="engine options, key=value")
    a = p.parse_args(argv)
    import jax
    import jax.monitoring

    from jaxkv import LLMEngine, SamplingParams

    jax.config.update("jax_enable_compilation_cache", False)
    opts = {}
    for kv in a.options:
        k, v = kv.split("=", 1)
        opts[k] = json.loads(v) if v[:1].isdigit() or v in ("true", "false", "null") else v
    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, d, **_: compiles.append(d) if name == BACKEND_COMPILE else None
    )
    t0 = time.perf_counter()
    eng = LLMEngine.from_pretrained(a.model, **opts)
    start_s = time.perf_counter() - t0
    report = eng.warmup_report or dict(programs=0, seconds=0.0)
    kinds = Counter(k.kind if hasattr(k, "kind") else k[0] for k in eng.runner.compiled)
    at_start = len(compiles)
    print(
        f"engine start {start_s:.1f} s, of which warm-up {report['seconds']:.1f} s: "
        f"{report['programs']} programs ({dict(kinds)}), {at_start} XLA compiles",
        file=sys.stderr,
    )

    rng = np.random.default_rng(0)
    vocab = eng.model_config.vocab_size
    kinds_of_request = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=40),
        dict(temperature=1.0, top_p=0.9, seed=1),
        dict(temperature=0.0, logprobs=5),
        dict(temperature=0.7, repetition_penalty=1.1),
    ]
    t1 = time.perf_counter()
    for i in range(a.requests):
        n = int(rng.integers(4, min(600, eng.max_model_len - a.max_tokens)))
        eng.add_request(
            rng.integers(0, vocab, n).tolist(),
            SamplingParams(
                max_tokens=int(rng.integers(1, a.max_tokens + 1)),
                **kinds_of_request[i % len(kinds_of_request)],
            ),
        )
        if i % 20 == 19:
            for _ in range(3):
                eng.step()
    eng.run_to_completion()
    run_s = time.perf_counter() - t1
    after = len(compiles) - at_start
    print(
        f"{a.requests} mixed requests in {run_s:.1f} s: {after} XLA compiles after warm-up",
        file=sys.stderr,
    )
    res = dict(
        model=a.model,
        options=opts,
        engine_start_s=start_s,
        warmup_s=report["seconds"],
        programs=report["programs"],
        program_kinds=kinds,
        xla_compiles_at_start=at_start,
        requests=a.requests,
        run_s=run_s,
        xla_compiles_after_warmup=after,
    )
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0 if after == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
