"""The server under load and faults: 64 concurrent streams with random
disconnects leave no request or page behind; SIGTERM drains the streams in
flight (aborting the long ones after --shutdown-timeout) and exits 0."""

from __future__ import annotations

import random
import signal
import threading
import time

import pytest

from jaxkv.core.engine import LLMEngine
from jaxkv.entrypoints.openai.server import build_app
from tests.helpers.model_utils import WORDS, make_hf_model, save_tiny_tokenizer
from tests.helpers.serve_utils import SSEStream, ThreadServer, get, metric, start_cli_server

MODEL = 'model_name="tiny"'


def _prompt(rng) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))


def test_64_streams_with_random_disconnects_leave_nothing_behind(tmp_path):
    _, path = make_hf_model("llama", tmp_path, max_position_embeddings=4096)
    save_tiny_tokenizer(path)
    eng = LLMEngine.from_pretrained(
        str(path), num_pages=1024, page_size=16, max_num_seqs=16, warmup=False
    )
    srv = ThreadServer(build_app(eng, ["tiny"]))
    rng = random.Random(0)
    # A dropped stream asks for far more tokens than it reads: only an abort
    # ends it before the test's deadline.
    jobs = [
        dict(prompt=_prompt(rng), drop=rng.random() < 0.3, after=rng.randint(1, 4), seed=i)
        for i in range(64)
    ]
    for j in jobs:
        j["max_tokens"] = 3000 if j["drop"] else rng.randint(4, 48)
    results: dict[int, tuple] = {}

    def client(i, job):
        s = SSEStream(
            srv.port,
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": job["prompt"],
                "max_tokens": job["max_tokens"],
                "temperature": 1.0,
                "seed": job["seed"],
                "ignore_eos": True,
            },
            timeout=120,
        )
        events = []
        for ev in s.events():
            events.append(ev)
            if job["drop"] and len(events) >= job["after"]:
                break
        s.close()
        results[i] = (s.status, events)

    threads = [
        threading.Thread(target=client, args=(i, j), daemon=True) for i, j in enumerate(jobs)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert len(results) == 64, "a client did not finish in time"
        for i, job in enumerate(jobs):
            status, events = results[i]
            assert status == 200
            if job["drop"]:
                continue
            assert events[-1] == "[DONE]", (i, events[-3:])
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        deadline = time.monotonic() + 20
        while True:
            text = get(srv.port, "/metrics")[1]
            idle = (
                metric(text, f"jaxkv:num_requests_running{{{MODEL}}}") == 0
                and metric(text, f"jaxkv:num_requests_waiting{{{MODEL}}}") == 0
                and metric(text, f"jaxkv:kv_cache_usage_perc{{{MODEL}}}") == 0
            )
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert idle, text
        assert eng.bm.num_used_pages == 0 and not eng.has_unfinished_requests()
        assert srv.app.state.engine_loop.num_in_flight() == 0
        served = sum(1 for j in jobs if not j["drop"])
        assert (
            metric(text, f'jaxkv:request_success_total{{finished_reason="length",{MODEL}}}')
            == served
        )
        assert (
            metric(text, f'jaxkv:request_success_total{{finished_reason="abort",{MODEL}}}')
            == len(jobs) - served
        )
        assert metric(text, f"jaxkv:generation_tokens_total{{{MODEL}}}") >= sum(
            j["max_tokens"] for j in jobs if not j["drop"]
        )
    finally:
        srv.stop()


@pytest.mark.slow
def test_sigterm_finishes_the_streams_in_flight_and_exits_0(tmp_path):
    # The timeout leaves the short streams ample time even while programs
    # compile on a loaded machine (no warm-up); the long ones need ~30,000
    # decode steps, far more than 10 s on any CPU.
    _, path = make_hf_model("llama", tmp_path, max_position_embeddings=32768)
    save_tiny_tokenizer(path)
    proc, port = start_cli_server(
        path,
        "--num-pages",
        "16384",
        "--page-size",
        "16",
        "--max-num-seqs",
        "16",
        "--shutdown-timeout",
        "10",
        "--no-warmup",
    )
    try:
        rng = random.Random(1)
        # 8 short streams finish within the timeout; 8 long ones cannot.
        jobs = [
            dict(prompt=_prompt(rng), max_tokens=16 if i % 2 == 0 else 30000) for i in range(16)
        ]
        results: dict[int, list] = {}
        started = threading.Barrier(17, timeout=120)

        def client(i, job):
            s = SSEStream(
                port,
                "/v1/completions",
                {
                    "model": str(path),
                    "prompt": job["prompt"],
                    "max_tokens": job["max_tokens"],
                    "temperature": 0,
                    "ignore_eos": True,
                },
                timeout=120,
            )
            events = s.events()
            got = [next(events)]
            started.wait()
            got.extend(events)
            results[i] = got

        threads = [
            threading.Thread(target=client, args=(i, j), daemon=True) for i, j in enumerate(jobs)
        ]
        for t in threads:
            t.start()
        started.wait()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0, proc.stdout.read()
        assert len(results) == 16
        for i, job in enumerate(jobs):
            events = results[i]
            assert events[-1] == "[DONE]", (i, events[-2:])
            reason = events[-2]["choices"][0]["finish_reason"]
            assert reason == ("length" if job["max_tokens"] == 16 else "abort"), (i, reason)
    finally:
        if proc.poll() is None:
            proc.kill()
