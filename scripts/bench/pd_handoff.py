"""The prefill/decode handoff alone: a prefill and a decode server (each on
its own core), idle otherwise, and --prompts long prompts sent to both as
sglang-router sends them (same body, bootstrap fields), one at a time; for
each transport (`--disaggregation-transfer-backend jax` and `tcp`) the
decode side's wire time and bytes (its /metrics) give MB/s and ms per
1,000 prompt tokens.

    python scripts/bench/pd_handoff.py --prompt-tokens 4096 --prompts 5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.common import TEXT  # noqa: E402
from scripts.bench.load_test import _free_port, start, stop  # noqa: E402
from scripts.bench.scale_out import _get, _post, counter  # noqa: E402


def run(args, transport: str) -> dict:
    pport, dport, bport = _free_port(), _free_port(), _free_port()
    base = [sys.executable, "-m", "jaxkv", "serve", "--model", args.model]
    base += ["--served-model-name", "m", "--disaggregation-transfer-backend", transport]
    pre = start(
        [
            "taskset",
            "-c",
            "0",
            *base,
            "--port",
            str(pport),
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bport),
        ],
        pport,
        "/health",
    )
    dec = start(
        ["taskset", "-c", "1", *base, "--port", str(dport), "--disaggregation-mode", "decode"],
        dport,
        "/health",
    )
    words, rng = TEXT.split(), random.Random(0)
    try:
        tokens = []
        for i in range(args.prompts + 1):  # the first compiles: not counted
            text = " ".join(
                words[(rng.randrange(len(words)) + j) % len(words)]
                for j in range(int(args.prompt_tokens * 0.75))
            )
            body = {
                "model": "m",
                "prompt": f"{i} {text}",
                "max_tokens": 1,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bport,
                "bootstrap_room": i,
            }
            if i == 1:
                before = _get(f"http://127.0.0.1:{dport}/metrics")
            with concurrent.futures.ThreadPoolExecutor(2) as ex:
                f = [
                    ex.submit(_post, f"http://127.0.0.1:{p}/v1/completions", body)
                    for p in (pport, dport)
                ]
                out = f[1].result()
                f[0].result()
            if i:
                tokens.append(out["usage"]["prompt_tokens"])
        after = _get(f"http://127.0.0.1:{dport}/metrics")
    finally:
        stop(pre)
        stop(dec)
    d = {
        k: counter(after, k) - counter(before, k)
        for k in (
            "jaxkv:kv_transfer_seconds_sum",
            "jaxkv:kv_transfer_bytes_total",
            "jaxkv:kv_transfer_pages_total",
        )
    }
    secs = d["jaxkv:kv_transfer_seconds_sum"]
    return {
        "pages": d["jaxkv:kv_transfer_pages_total"],
        "MB": d["jaxkv:kv_transfer_bytes_total"] / 1e6,
        "seconds": secs,
        "MB_per_s": d["jaxkv:kv_transfer_bytes_total"] / 1e6 / secs,
        "ms_per_1000_prompt_tokens": 1e3 * secs / (sum(tokens) / 1e3),
        "prompt_tokens": tokens,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    res = {t: run(a, t) for t in ("jax", "tcp")}
    res["args"] = vars(a)
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
