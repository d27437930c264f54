"""Scale-out benchmarks: jaxkv workers behind sglang-router, the
prefill/decode split, and data-parallel replicas. Each server is pinned to
its own core(s) with `taskset`, so configurations compare like with like.

    python scripts/bench/scale_out.py routing   # cache_aware vs round_robin vs one worker
    python scripts/bench/scale_out.py pd        # ITL of running streams, colocated vs split
    python scripts/bench/scale_out.py dp        # throughput at dp 1 and dp 2

routing: 48 multi-turn chats (3-5 turns, 4 shared system prompts), 8 at a
time, through sglang-router over 2 workers (`cache_aware`, `round_robin`)
and on one worker with both pools and cores. Reported: prompt tokens
computed (less prefix hits, from /metrics), TTFT p50 / p99, output tok/s.

pd: 16 streams of 256 tokens while a long prompt (--long-tokens) arrives
every --every s, through the router: 2 colocated workers against 1 prefill
+ 1 decode server. Reported: the streams' ITL p50 / p99, the handoff's
MB/s and ms per 1,000 prompt tokens.

Every figure is the median of --runs runs (caches flushed before each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.common import TEXT  # noqa: E402
from scripts.bench.load_test import _free_port, _pct, one, start, stop  # noqa: E402


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=30).read().decode()


def _post(url: str, body: dict) -> dict:
    head = {"Content-Type": "application/json"}
    req = urllib.request.Request(url, json.dumps(body).encode(), head, method="POST")
    return json.loads(urllib.request.urlopen(req, timeout=60).read() or b"{}")


def counter(text: str, name: str) -> float:
    """The sum of a Prometheus family's samples (every label set)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def computed(urls: list[str]) -> float:
    """Prompt tokens computed so far (prompt tokens less prefix-cache hits)."""
    total = 0.0
    for u in urls:
        t = _get(u + "/metrics")
        total += counter(t, "jaxkv:prompt_tokens_total") - counter(
            t, "jaxkv:prefix_cache_hits_total"
        )
    return total


def worker(args, port: int, cores: str, *extra: str) -> subprocess.Popen:
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "jaxkv", "serve", "--model", args.model]
    cmd += ["--port", str(port), "--served-model-name", "m", *extra]
    return start(cmd, port, "/health")


def router(urls_or_pd: list[str], policy: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", *urls_or_pd]
    cmd += ["--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--log-level", "error"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            body = _get(f"http://127.0.0.1:{port}/workers")
            if body.count('"is_healthy":true') >= 2:
                return proc, port
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("sglang-router did not come up")


# ------------------------------------------------------------------ routing


def chats(n: int, seed: int) -> list[list[dict]]:
    """n conversations of 3-5 user turns (each a question on a 40-80 word
    excerpt) over 4 shared system prompts."""
    rng = random.Random(seed)
    words = TEXT.split()
    systems = [
        f"You are assistant {k}. Use this passage as context: "
        + " ".join(words[k * 40 : k * 40 + 150])
        for k in range(4)
    ]

    def turn(i, t):  # a question about a 40-80 word excerpt
        k = rng.randrange(len(words) - 80)
        excerpt = " ".join(words[k : k + rng.randint(40, 80)])
        return {"role": "user", "content": f"Chat {i}, turn {t}: what does this say? {excerpt}"}

    return [
        [{"role": "system", "content": systems[i % 4]}]
        + [turn(i, t) for t in range(rng.randint(3, 5))]
        for i in range(n)
    ]


async def run_chats(url: str, convs: list[list[dict]], clients: int, max_tokens: int) -> dict:
    import openai

    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    todo, results = list(convs), []

    async def client():
        while todo:
            conv = todo.pop(0)
            msgs = [conv[0]]
            for turn in conv[1:]:
                msgs.append(turn)
                req = {"messages": list(msgs), "max_tokens": max_tokens, "temperature": 0}
                r = await one(c, "m", req)
                results.append(r)
                msgs.append({"role": "assistant", "content": r["text"]})

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await c.close()
    ttft = [r["times"][0] - r["t0"] for r in results if r["times"]]
    return {
        "requests": len(results),
        "wall_s": wall,
        "output_tok_per_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
    }


def routing(args) -> dict:
    convs = chats(args.chats, seed=0)
    pages = str(args.pages)
    ports = [_free_port(), _free_port()]
    procs = [worker(args, p, str(i), "--num-pages", pages) for i, p in enumerate(ports)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    out = {}
    try:
        asyncio.run(run_chats(urls[0], chats(2, seed=9), 2, args.max_tokens))  # compile
        asyncio.run(run_chats(urls[1], chats(2, seed=9), 2, args.max_tokens))
        for policy in ("cache_aware", "round_robin"):
            rp, port = router(["--worker-urls", *urls], policy)
            runs = []
            try:
                for _ in range(args.runs):
                    for u in urls:
                        _post(u + "/flush_cache", {})
                    before = computed(urls)
                    r = asyncio.run(
                        run_chats(f"http://127.0.0.1:{port}", convs, args.clients, args.max_tokens)
                    )
                    r["prompt_tokens_computed"] = computed(urls) - before
                    runs.append(r)
                    print(f"routing {policy}: {r}", file=sys.stderr)
            finally:
                stop(rp)
            out[policy] = _median_run(runs)
    finally:
        for p in procs:
            stop(p)
    port = _free_port()
    one_proc = worker(args, port, "0,1", "--num-pages", str(2 * args.pages))
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(run_chats(url, chats(2, seed=9), 2, args.max_tokens))
        runs = []
        for _ in range(args.runs):
            _post(url + "/flush_cache", {})
            before = computed([url])
            r = asyncio.run(run_chats(url, convs, args.clients, args.max_tokens))
            r["prompt_tokens_computed"] = computed([url]) - before
            runs.append(r)
            print(f"routing one worker: {r}", file=sys.stderr)
        out["one_worker"] = _median_run(runs)
    finally:
        stop(one_proc)
    out["cache_aware_over_round_robin"] = (
        out["cache_aware"]["prompt_tokens_computed"] / out["round_robin"]["prompt_tokens_computed"]
    )
    return out


def _median_run(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in keys}
    return {**med, "runs": runs}


# ----------------------------------------------------------------------- pd


async def pd_load(url: str, args) -> dict:
    """args.streams streams of args.stream_tokens tokens; a long prompt every
    args.every s while they run."""
    import openai

    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    words = TEXT.split()
    long_text = " ".join(words[i % len(words)] for i in range(int(args.long_tokens * 0.75)))
    streams = [
        one(
            c,
            "m",
            {
                "messages": [{"role": "user", "content": f"Story {i}: tell it."}],
                "max_tokens": args.stream_tokens,
                "temperature": 0,
                "extra_body": {"ignore_eos": True},
            },
        )
        for i in range(args.streams)
    ]
    tasks = [asyncio.create_task(s) for s in streams]
    longs = []
    rng = random.Random(1)
    while not all(t.done() for t in tasks):
        req = {
            "messages": [{"role": "user", "content": f"{rng.random()} {long_text}"}],
            "max_tokens": 1,
            "temperature": 0,
        }
        longs.append(asyncio.create_task(one(c, "m", req)))
        await asyncio.sleep(args.every)
    res = [t.result() for t in tasks]
    long_res = await asyncio.gather(*longs)
    await c.close()
    itl = [b - a for r in res for a, b in zip(r["times"], r["times"][1:])]
    return {
        "itl_p50_s": _pct(itl, 50),
        "itl_p99_s": _pct(itl, 99),
        "long_prompts": len(long_res),
        "long_ttft_p50_s": _pct([r["times"][0] - r["t0"] for r in long_res if r["times"]], 50),
    }


def pd(args) -> dict:
    out = {}
    ports = [_free_port(), _free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [worker(args, p, str(i)) for i, p in enumerate(ports)]
    try:
        out["colocated"] = _pd_runs(args, ["--worker-urls", *urls], urls)
    finally:
        for p in procs:
            stop(p)
    bport = _free_port()
    procs = [
        worker(
            args,
            ports[0],
            "0",
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bport),
        ),
        worker(args, ports[1], "1", "--disaggregation-mode", "decode"),
    ]
    try:
        pdargs = ["--pd-disaggregation", "--prefill", urls[0], str(bport), "--decode", urls[1]]
        out["split"] = _pd_runs(args, pdargs, urls)
        t = _get(urls[1] + "/metrics")
        pages = counter(t, "jaxkv:kv_transfer_pages_total")
        nbytes = counter(t, "jaxkv:kv_transfer_bytes_total")
        secs = counter(t, "jaxkv:kv_transfer_seconds_sum")
        info = json.loads(_get(urls[1] + "/get_server_info"))
        out["handoff"] = {
            "pages": pages,
            "MB_per_s": nbytes / 1e6 / secs if secs else None,
            "ms_per_1000_prompt_tokens": 1e3 * secs / (pages * info["page_size"] / 1e3)
            if pages
            else None,
        }
    finally:
        for p in procs:
            stop(p)
    out["itl_p99_split_over_colocated"] = out["split"]["itl_p99_s"] / out["colocated"]["itl_p99_s"]
    return out


def _pd_runs(args, router_args: list[str], urls: list[str]) -> dict:
    rp, port = router(router_args, "round_robin")
    url = f"http://127.0.0.1:{port}"
    try:
        small = argparse.Namespace(**{**vars(args), "streams": 2, "stream_tokens": 8})
        asyncio.run(pd_load(url, small))  # compile
        runs = []
        for _ in range(args.runs):
            for u in urls:
                _post(u + "/flush_cache", {})
            r = asyncio.run(pd_load(url, args))
            print(f"pd {router_args[0]}: {r}", file=sys.stderr)
            runs.append(r)
        return _median_run(runs)
    finally:
        stop(rp)


# ----------------------------------------------------------------------- dp


def dp(args) -> dict:
    from scripts.bench.load_test import run_load, workload

    reqs = workload(args.requests, seed=0)
    out = {}
    for n in (1, 2):
        port = _free_port()
        cmd = [
            "taskset",
            "-c",
            "0,1",
            sys.executable,
            "-m",
            "jaxkv",
            "serve",
            "--model",
            args.model,
            "--port",
            str(port),
            "--served-model-name",
            "m",
            "--data-parallel-size",
            str(n),
        ]
        proc = start(cmd, port, "/health")
        url = f"http://127.0.0.1:{port}/v1"
        try:
            asyncio.run(run_load(url, "m", workload(8, seed=9), 8, 600))
            runs = []
            for _ in range(args.runs):
                r = asyncio.run(run_load(url, "m", reqs, args.clients, 900))
                print(f"dp {n}: {r['output_tok_per_s']:.1f} tok/s", file=sys.stderr)
                runs.append(
                    {
                        k: r[k]
                        for k in (
                            "output_tok_per_s",
                            "requests_per_s",
                            "ttft_p50_s",
                            "itl_p99_s",
                            "lost",
                        )
                    }
                )
            out[f"dp{n}"] = _median_run(runs)
        finally:
            stop(proc)
    out["dp2_over_dp1"] = out["dp2"]["output_tok_per_s"] / out["dp1"]["output_tok_per_s"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("routing", "pd", "dp"))
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--chats", type=int, default=48)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pages", type=int, default=512, help="routing: pages per worker")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--long-tokens", type=int, default=4096)
    p.add_argument("--every", type=float, default=2.0)
    p.add_argument("--requests", type=int, default=64, help="dp: requests per run")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    res = {**{"routing": routing, "pd": pd, "dp": dp}[a.what](a), "args": vars(a)}
    text = json.dumps(res, indent=1, default=str)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
