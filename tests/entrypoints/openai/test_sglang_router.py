"""jaxkv workers behind the real router: sglang-router (the SGLang Model
Gateway, its Rust binary from PyPI, run unmodified) in front of two tiny
servers, driven by the `openai` client.

- answers through the router equal a lone worker's, greedy and seeded;
- `cache_aware` keeps a conversation on one worker, so the workers serve
  more prompt tokens from their prefix caches than under `round_robin`
  (counted by the workers' own /metrics);
- a worker that dies: the router's health check drops it and the other
  serves every later request; nothing hangs.
"""

from __future__ import annotations

import subprocess
import sys
import time

import openai
import pytest

from tests.helpers.serve_utils import ThreadServer, free_port, get, metric, post

pytest.importorskip("sglang_router")

CONVERSATIONS = 5  # odd: round robin moves each conversation between the workers
TURNS = 3


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    from jaxkv.core.engine import LLMEngine
    from jaxkv.entrypoints.openai.server import build_app
    from scripts.probe.common import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("router") / "model")
    out = []
    for _ in range(2):
        eng = LLMEngine.from_pretrained(
            str(path), num_pages=256, page_size=16, max_num_seqs=4, warmup=False
        )
        out.append(ThreadServer(build_app(eng, ["tiny"], model_path=str(path))))
    yield out
    for s in out:
        s.stop()


def start_router(urls: list[str], policy: str, tmp_path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(tmp_path / f"router-{policy}.log", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--worker-urls",
            *urls,
            "--policy",
            policy,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
            "--log-level",
            "warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / f"router-{policy}.log").read_text()[-2000:]
        try:
            st, body = get(port, "/workers", timeout=2)
            if st == 200 and body.count('"is_healthy":true') == len(urls):
                return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("sglang-router did not see its workers healthy within 60 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60
    )


def system_prompt(c: int) -> str:
    return f"You are assistant number {c}. " + " ".join(
        f"Rule {c}.{i}: answer briefly and kindly." for i in range(12)
    )


def run_conversations(c: openai.OpenAI) -> list[str]:
    """CONVERSATIONS chats of TURNS turns, greedy, turn by turn across the
    chats (so a worker sees the others between a chat's turns)."""
    chats = [[{"role": "system", "content": system_prompt(k)}] for k in range(CONVERSATIONS)]
    answers = []
    for t in range(TURNS):
        for k, msgs in enumerate(chats):
            msgs.append({"role": "user", "content": f"Question {t} of chat {k}?"})
            out = c.chat.completions.create(
                model="tiny", messages=msgs, max_tokens=6, temperature=0
            )
            text = out.choices[0].message.content
            msgs.append({"role": "assistant", "content": text})
            answers.append(text)
    return answers


def prefix_hits(workers) -> float:
    return sum(
        metric(get(w.port, "/metrics")[1], 'jaxkv:prefix_cache_hits_total{model_name="tiny"}')
        for w in workers
    )


def flush(workers) -> None:
    for w in workers:
        st, got = post(w.port, "/flush_cache", {})
        assert st == 200, got


def test_answers_equal_a_lone_worker_and_cache_aware_hits_more(workers, tmp_path):
    lone = run_conversations(client(workers[0].port))
    seeded = dict(model="tiny", prompt="Tell me a story", max_tokens=8, temperature=0.9, seed=7)
    lone_seeded = client(workers[0].port).completions.create(**seeded).choices[0].text
    hits = {}
    for policy in ("cache_aware", "round_robin"):
        flush(workers)
        proc, port = start_router([w.base_url for w in workers], policy, tmp_path)
        try:
            before = prefix_hits(workers)
            assert run_conversations(client(port)) == lone, policy
            hits[policy] = prefix_hits(workers) - before
            for _ in range(2):  # seeded sampling lands the same on either worker
                got = client(port).completions.create(**seeded).choices[0].text
                assert got == lone_seeded, policy
        finally:
            stop(proc)
    # cache_aware: every later turn finds its chat's pages; round robin: the
    # odd number of chats moves each to the other worker every turn
    assert hits["cache_aware"] > 1.5 * hits["round_robin"], hits


def test_a_dead_worker_is_dropped_and_the_other_serves(workers, tmp_path):
    proc, port = start_router([w.base_url for w in workers], "round_robin", tmp_path)
    try:
        c = client(port)
        assert c.completions.create(model="tiny", prompt="Hi", max_tokens=2).choices
        dead = workers[1]
        dead.server.force_exit = True
        dead.stop()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the health check notices within seconds
            st, body = get(port, "/workers", timeout=5)
            if body.count('"is_healthy":true') == 1 or body.count('"url"') == 1:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the router still counts the dead worker healthy: {body}")
        t0 = time.monotonic()
        for i in range(6):
            out = c.completions.create(model="tiny", prompt=f"Hello {i}", max_tokens=2)
            assert out.choices[0].finish_reason in ("length", "stop")
        assert time.monotonic() - t0 < 30
    finally:
        stop(proc)
