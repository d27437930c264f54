"""Prefill/decode disaggregation (`pd`) behind the real router:
sglang-router `--pd-disaggregation` in front of a prefill and a decode
server (tiny model, one process), driven by the `openai` client.

- answers equal a lone offline run (`LLM`), greedy and seeded, and the
  decode side computes at most the prompt's last page itself (the rest
  arrive as host-tier hits);
- pages that never come, a prefill side that closes mid-transfer and a
  forged page each end the decode request with a named error, and the
  decode pool comes back whole;
- pages nobody collects are dropped after the room timeout.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

from jaxkv import LLM, SamplingParams
from tests.helpers.serve_utils import ThreadServer, free_port, get, metric, request

pytest.importorskip("sglang_router")

PAGE = 16
ENGINE = dict(num_pages=96, page_size=PAGE, max_num_seqs=4, warmup=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from scripts.probe.common import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("pd") / "model"))


@pytest.fixture(scope="module")
def sides(model):
    from jaxkv.core.engine import LLMEngine
    from jaxkv.entrypoints.openai.server import build_app

    bport = free_port()
    pe = LLMEngine.from_pretrained(model, **ENGINE)
    de = LLMEngine.from_pretrained(model, **ENGINE, kv_offload_memory=32 * 2**20)
    p = ThreadServer(
        build_app(
            pe,
            ["tiny"],
            disaggregation_mode="prefill",
            disaggregation_bootstrap_port=bport,
            disaggregation_transfer_timeout=1.5,
            disaggregation_room_timeout=2.0,
        )
    )
    d = ThreadServer(
        build_app(de, ["tiny"], disaggregation_mode="decode", disaggregation_transfer_timeout=5)
    )
    p.bport, d.engine = bport, de
    yield p, d
    p.stop()
    d.stop()


@pytest.fixture(scope="module")
def router(sides, tmp_path_factory):
    p, d = sides
    port = free_port()
    log = tmp_path_factory.mktemp("pdlog") / "router.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill",
            p.base_url,
            str(p.bport),
            "--decode",
            d.base_url,
            "--policy",
            "round_robin",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warn",
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            st, body = get(port, "/workers", timeout=2)
            if st == 200 and body.count('"is_healthy":true') == 2:
                break
        except OSError:
            pass
        time.sleep(0.2)
    yield port
    proc.terminate()
    proc.wait(10)


def free_and_tier(engine) -> tuple[int, int]:
    return engine.bm.num_free_pages, len(engine.tier)


@pytest.mark.parametrize("transport", ["jax", "tcp"])
def test_split_answers_equal_a_lone_run_and_decode_computes_one_page_at_most(
    sides, router, model, transport
):
    p, d = sides
    handoff = d.app.state.handoff
    if transport == "jax" and handoff.jax is None:
        pytest.skip("JAX's transfer server does not start here")
    saved, handoff.jax = handoff.jax, handoff.jax if transport == "jax" else None
    try:
        _split_equals_lone(p, d, router, model, transport)
    finally:
        handoff.jax = saved


def _split_equals_lone(p, d, router, model, transport):
    oracle = LLM(model, **{**ENGINE, "max_num_seqs": 1})
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{router}/v1", api_key="x", max_retries=0)
    pages = 'jaxkv:kv_transfer_pages_total{direction="received",model_name="tiny",transport="%s"}'
    before = _metric_or_0(get(d.port, "/metrics")[1], pages % transport)
    for n in (5, 9):  # two prompt lengths: a different partial last page each
        prompt = f"The page pool of a {transport} cache " * n
        for kw in (dict(temperature=0), dict(temperature=0.8, seed=5)):
            request(d.port, "POST", "/flush_cache", {})  # every page must come from the prefill
            want = oracle.generate(prompt, SamplingParams(max_tokens=8, **kw))[0]
            got = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, **kw)
            assert got.choices[0].text == want.outputs[0].text, kw
            # every full page came from the prefill side: at most the last page computed
            n_ids = len(want.prompt_token_ids)
            assert got.usage.prompt_tokens_details.cached_tokens == (n_ids - 1) // PAGE * PAGE
    msgs = [{"role": "user", "content": f"Say something about {transport} pages. " * 4}]
    got = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
    want = oracle.chat(msgs, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text
    assert got.choices[0].message.content == want
    text = get(d.port, "/metrics")[1]
    assert metric(text, pages % transport) > before
    assert metric(text, 'jaxkv:kv_offload_hit_tokens_total{model_name="tiny",tier="host"}') > 0


def _metric_or_0(text: str, name: str) -> float:
    """A labelled counter's value; 0 before its label set first counted."""
    try:
        return metric(text, name)
    except KeyError:
        return 0.0


def _decode_ask(d, port: int, room: int, prompt: str):
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 2,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
        "bootstrap_room": room,
    }
    return request(d.port, "POST", "/v1/completions", body)


def test_pages_that_never_come_end_the_request_by_name(sides):
    p, d = sides
    before = free_and_tier(d.engine)
    st, _, err = _decode_ask(d, p.bport, 424242, "Nobody prefills this prompt " * 6)
    assert st == 503 and "no prefill of room 424242" in err["error"]["message"], err
    assert free_and_tier(d.engine) == before


class FakePrefill:
    """A bootstrap port that answers `pages` frames as `frames(size)` gives
    them, then closes."""

    def __init__(self, frames):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.frames = frames
        threading.Thread(target=self._one, daemon=True).start()

    def _one(self):
        conn, _ = self.sock.accept()
        with conn, conn.makefile("rb") as f:
            ask = json.loads(f.readline())
            for chunk in self.frames(ask):
                conn.sendall(chunk)
        self.sock.close()


def test_a_prefill_side_that_closes_or_forges_is_refused_by_name(sides):
    from jaxkv.entrypoints.openai.pd import PageFormat

    _, d = sides
    fmt = PageFormat(d.engine)
    before = free_and_tier(d.engine)

    def closing(ask):
        yield json.dumps({"pages": 2, "page_bytes": fmt.size}).encode() + b"\n"
        yield bytes.fromhex(ask["hashes"][0]) + b"\0" * (fmt.size // 2)

    st, _, err = _decode_ask(d, FakePrefill(closing).port, 1, "Half a transfer here " * 12)
    assert st == 503 and "closed the transfer after 0 of 2 pages" in err["error"]["message"]

    def forged(ask):
        yield json.dumps({"pages": 1, "page_bytes": fmt.size}).encode() + b"\n"
        yield bytes.fromhex(ask["hashes"][0]) + b"\1" * fmt.size

    st, _, err = _decode_ask(d, FakePrefill(forged).port, 2, "A forged page here " * 6)
    assert st == 503 and "page 0 refused" in err["error"]["message"], err
    st, _, err = _decode_ask(d, free_port(), 3, "Nobody listens here " * 6)
    assert st == 503 and "not reachable" in err["error"]["message"]
    assert free_and_tier(d.engine) == before


def test_pages_nobody_collects_are_dropped(sides):
    p, _ = sides
    rooms = p.app.state.handoff.rooms
    body = {"model": "tiny", "prompt": "Uncollected " * 20, "max_tokens": 4, "bootstrap_room": 7}
    st, _, out = request(p.port, "POST", "/v1/completions", body)
    assert st == 200 and len(out["choices"][0]["text"]) > 0
    assert 7 in rooms
    expired = rooms.expired
    deadline = time.monotonic() + 10
    while 7 in rooms and time.monotonic() < deadline:
        time.sleep(0.2)
    assert 7 not in rooms and rooms.expired == expired + 1
