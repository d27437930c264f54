"""Load test of an OpenAI-compatible server: N concurrent streaming clients
(the `openai` package's async client) over loopback, a fixed mixed workload,
then it stops by itself (a bounded number of requests and a time limit).

    python scripts/bench/load_test.py                      # starts `jaxkv serve` itself
    python scripts/bench/load_test.py --peer llamacpp      # and llama-cpp-python's server
    python scripts/bench/load_test.py --url http://127.0.0.1:8000/v1 --model NAME

Reports requests/s, output tok/s, time to first token and inter-token
latency percentiles, errors, and requests lost (sent minus answered: must
be 0). With --peer llamacpp the same workload runs against
`python -m llama_cpp.server` on the same GGUF file and the table shows both
side by side (llama-cpp-python is an optional extra: it builds llama.cpp
from source).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.common import TEXT  # noqa: E402

QUESTIONS = [
    "Summarize the story in one sentence.",
    "Who rang the bell, and why?",
    "List the boats expected that day.",
    "What did the harbour master fear?",
    "Write a short poem about the town.",
    "What happened at noon?",
    "Describe the smell of the bakery.",
    "Why did the older sailors distrust the water?",
]


def workload(n: int, seed: int) -> list[dict]:
    """n chat requests: a passage of 0-300 words as context, a question, and
    an output length drawn log-normally (median 64 tokens, 8 to 256)."""
    rng = random.Random(seed)
    words = TEXT.split()
    out = []
    for i in range(n):
        k = min(len(words), int(rng.lognormvariate(4.0, 1.0)))
        context = " ".join(words[:k])
        q = rng.choice(QUESTIONS)
        out.append(
            {
                "messages": [{"role": "user", "content": f"{context}\n\n{q}" if k else q}],
                "max_tokens": max(8, min(256, int(rng.lognormvariate(4.16, 0.6)))),
                "temperature": 0.8,
                "seed": seed * 100003 + i,
            }
        )
    return out


async def one(client, model: str, req: dict) -> dict:
    t0 = time.perf_counter()
    times, tokens, reason, text = [], None, None, []
    stream = await client.chat.completions.create(
        model=model, stream=True, stream_options={"include_usage": True}, **req
    )
    async for ch in stream:
        if ch.choices:
            c = ch.choices[0]
            if c.delta.content:
                times.append(time.perf_counter())
                text.append(c.delta.content)
            reason = c.finish_reason or reason
        if getattr(ch, "usage", None) is not None:
            tokens = ch.usage.completion_tokens
    return {
        "t0": t0,
        "times": times,
        "end": time.perf_counter(),
        "tokens": tokens if tokens is not None else len(times),
        "finish_reason": reason,
        "text": "".join(text),
    }


async def run_load(url: str, model: str, reqs: list[dict], clients: int, time_limit: float):
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    todo = list(reqs)
    results, errors, sent = [], [], 0
    deadline = time.perf_counter() + time_limit

    async def worker():
        nonlocal sent
        while todo and time.perf_counter() < deadline:
            req = todo.pop(0)
            sent += 1
            try:
                r = await one(client, model, req)
                (results if r["finish_reason"] else errors).append(
                    r if r["finish_reason"] else "no finish reason"
                )
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    return summarize(results, errors, sent, wall)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(results: list[dict], errors: list, sent: int, wall: float) -> dict:
    ttft = [r["times"][0] - r["t0"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    tpot = [
        (r["end"] - r["times"][0]) / (r["tokens"] - 1)
        for r in results
        if r["times"] and r["tokens"] > 1
    ]
    toks = sum(r["tokens"] for r in results)
    return {
        "sent": sent,
        "answered": len(results) + len(errors),
        "lost": sent - len(results) - len(errors),
        "errors": len(errors),
        "error_examples": errors[:3],
        "wall_s": wall,
        "requests_per_s": len(results) / wall,
        "output_tok_per_s": toks / wall,
        "output_tokens": toks,
        **{f"ttft_p{q}_s": _pct(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_s": _pct(itl, q) for q in (50, 90, 99)},
        "tpot_p50_s": _pct(tpot, 50),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, health: str, timeout: float = 900) -> subprocess.Popen:
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{health}", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not healthy after {timeout} s: {' '.join(cmd)}")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def measure(name: str, url: str, model: str, args, reqs: list[dict]) -> dict:
    print(f"load_test: {name}: warm-up ...", file=sys.stderr)
    asyncio.run(
        run_load(
            url, model, workload(min(16, args.clients), seed=999), args.clients, args.time_limit
        )
    )
    runs = []
    for i in range(args.runs):
        r = asyncio.run(run_load(url, model, reqs, args.clients, args.time_limit))
        print(
            f"load_test: {name} run {i + 1}/{args.runs}: {r['output_tok_per_s']:.1f} output "
            f"tok/s, {r['requests_per_s']:.2f} req/s, lost {r['lost']}",
            file=sys.stderr,
        )
        runs.append(r)
    runs.sort(key=lambda r: r["output_tok_per_s"])
    return {**runs[len(runs) // 2], "runs": runs}


def report(rows: dict[str, dict]) -> str:
    fields = [
        ("requests/s", "requests_per_s", 1),
        ("output tok/s", "output_tok_per_s", 1),
        ("TTFT p50 (s)", "ttft_p50_s", 1),
        ("TTFT p90 (s)", "ttft_p90_s", 1),
        ("TTFT p99 (s)", "ttft_p99_s", 1),
        ("ITL p50 (ms)", "itl_p50_s", 1000),
        ("ITL p90 (ms)", "itl_p90_s", 1000),
        ("ITL p99 (ms)", "itl_p99_s", 1000),
        ("TPOT p50 (ms)", "tpot_p50_s", 1000),
        ("errors", "errors", 1),
        ("lost requests", "lost", 1),
    ]
    names = list(rows)
    lines = [
        "| figure | " + " | ".join(names) + (" | ratio |" if len(names) == 2 else " |"),
        "|---" * (len(names) + 1 + (len(names) == 2)) + "|",
    ]
    for label, key, scale in fields:
        vals = [rows[n].get(key) for n in names]
        cells = [
            "-" if v is None else f"{v * scale:.3g}" if isinstance(v, float) else str(v)
            for v in vals
        ]
        ratio = ""
        if (
            len(names) == 2
            and all(isinstance(v, (int, float)) and v for v in vals)
            and key not in ("errors", "lost")
        ):
            ratio = f" {vals[0] / vals[1]:.2f}x |"
        lines.append(
            f"| {label} | " + " | ".join(cells) + (" |" + ratio if len(names) == 2 else " |")
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running server's /v1 address (else one is started)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model (name or path)")
    p.add_argument("--clients", type=int, default=64, help="concurrent clients")
    p.add_argument("--requests", type=int, default=256, help="requests per run")
    p.add_argument("--runs", type=int, default=1, help="runs (the median run is reported)")
    p.add_argument("--time-limit", type=float, default=900, help="seconds per run at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peer", choices=["llamacpp"], help="also load llama-cpp-python's server")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra `jaxkv serve` option (repeatable, e.g. --serve-arg=--warmup)",
    )
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    reqs = workload(a.requests, a.seed)
    rows = {}
    if a.url:
        rows["server"] = measure("server", a.url, a.model, a, reqs)
    else:
        port = _free_port()
        proc = start(
            [
                sys.executable,
                "-m",
                "jaxkv",
                "serve",
                "--model",
                a.model,
                "--port",
                str(port),
                "--served-model-name",
                "m",
                *a.serve_arg,
            ],
            port,
            "/health",
        )
        try:
            rows["jaxkv"] = measure("jaxkv", f"http://127.0.0.1:{port}/v1", "m", a, reqs)
        finally:
            stop(proc)
    if a.peer == "llamacpp":
        from checkpoints.known_models import DEFAULT_MODEL, fetch_smollm2_gguf

        if a.model == DEFAULT_MODEL:
            gguf = fetch_smollm2_gguf()
        elif a.model.endswith(".gguf"):
            gguf = Path(a.model)
        else:
            raise SystemExit("--peer llamacpp needs --model to be a GGUF file or the default")
        port = _free_port()
        proc = start(
            [
                sys.executable,
                "-m",
                "llama_cpp.server",
                "--model",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--n_ctx",
                "8192",
            ],
            port,
            "/v1/models",
        )
        try:
            rows["llama.cpp"] = measure("llama.cpp", f"http://127.0.0.1:{port}/v1", "m", a, reqs)
        finally:
            stop(proc)
    print(f"{a.clients} clients, {a.requests} requests per run, median of {a.runs} run(s)")
    print(report(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if all(r["lost"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
