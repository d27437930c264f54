"""The endpoints routers call (`router_routes`) and the KV events
(`kv_events`), on one tiny server with events on.

The events are checked against what they describe, not against the code
that sends them: each BlockStored's token ids must be the page of the
prompt the engine ran (the render endpoint's ids, and the completion's
usage), and its hash chain must be the pool's own (`hash_page`)."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from jaxkv.core.scheduling.page_pool import hash_page
from jaxkv.entrypoints.openai.kv_events import block_hash
from tests.helpers.serve_utils import ThreadServer, free_port, request

PAGE = 16
KEY = "router-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def post(port, path, body, headers=None):
    st, _, got = request(port, "POST", path, body, {**AUTH, **(headers or {})})
    return st, got


def get_json(port, path):
    st, _, got = request(port, "GET", path, None, AUTH)
    return st, got


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from jaxkv.core.engine import LLMEngine
    from jaxkv.entrypoints.openai.server import build_app
    from scripts.probe.common import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("router") / "model")
    eng = LLMEngine.from_pretrained(
        str(path), num_pages=24, page_size=PAGE, max_num_seqs=4, warmup=False
    )
    port, replay = free_port(), free_port()
    cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": "kv",
    }
    s = ThreadServer(
        build_app(eng, ["tiny"], kv_events_config=cfg, model_path=str(path), api_key=KEY)
    )
    s.engine, s.events_port, s.replay_port = eng, port, replay
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sub(srv):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.connect(f"tcp://127.0.0.1:{srv.events_port}")
    sock.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # a SUB socket misses what is sent before it joins
    yield sock
    ctx.destroy(linger=0)


def _drain(sock, wait: float = 2.0) -> list:
    """Every event batch that arrives within `wait` s of the last one."""
    out = []
    while sock.poll(int(wait * 1000)):
        topic, seq, payload = sock.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        wait = 0.3
    return out


def test_server_and_model_info(srv):
    for path in ("/get_server_info", "/server_info"):
        st, info = get_json(srv.port, path)
        assert st == 200
        assert info["kv_block_size"] == PAGE and info["dp_size"] == 1 and info["tp_size"] == 1
        assert info["max_model_len"] == srv.engine.max_model_len
        assert info["disaggregation_mode"] == "null" and info["instance_id"]
    for path in ("/get_model_info", "/model_info"):
        st, info = get_json(srv.port, path)
        assert st == 200 and info["is_generation"] is True and info["model_type"] == "llama"


def test_render_is_what_the_engine_ran_and_its_pages_are_announced(srv, sub):
    _drain(sub, 0.2)
    prompt = "The quick brown fox jumps over the lazy dog " * 6
    st, r = post(srv.port, "/v1/completions/render", {"model": "tiny", "prompt": prompt})
    assert st == 200, r
    ids = r["prompt_token_ids"]
    st, tok = post(srv.port, "/tokenize", {"prompt": prompt})
    assert ids == tok["tokens"] and len(ids) > 3 * PAGE
    st, out = post(
        srv.port,
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0},
    )
    assert st == 200 and out["usage"]["prompt_tokens"] == len(ids)
    stored = [ev for _, (ts, evs, rank) in _drain(sub) for ev in evs if ev[0] == "BlockStored"]
    # every full page of the prompt (the last token's page may be partial)
    want = [ids[i * PAGE : (i + 1) * PAGE] for i in range(len(ids) // PAGE)]
    assert [ev[3] for ev in stored[: len(want)]] == want
    parent = b""
    for ev, toks in zip(stored, want):
        h = hash_page(parent, toks)
        assert ev[1] == [block_hash(h)] and ev[4] == PAGE and ev[-1] == "GPU"
        assert ev[2] == (block_hash(parent) if parent else None)
        parent = h


def test_chat_render_matches_tokenize_and_usage(srv):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}]}
    st, r = post(srv.port, "/v1/chat/completions/render", body)
    assert st == 200, r
    st, tok = post(srv.port, "/tokenize", {"messages": body["messages"]})
    assert r["prompt_token_ids"] == tok["tokens"]
    assert "Hi there" in r["requests"][0]["prompt"]
    st, out = post(srv.port, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert out["usage"]["prompt_tokens"] == len(r["prompt_token_ids"])
    st, bad = post(srv.port, "/v1/chat/completions/render", {"model": "tiny"})
    assert st == 400 and "messages" in bad["error"]["message"]


def test_flush_cache_forgets_unheld_pages_and_says_so(srv, sub):
    prompt = "Once upon a time in a land far away " * 6
    post(srv.port, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    _drain(sub, 1.0)
    assert srv.engine.bm.num_cached_pages > 0
    st, got = post(srv.port, "/flush_cache", {})
    assert st == 200 and got["device_pages"] > 0
    assert srv.engine.bm.num_cached_pages == 0
    evs = [ev for _, (_, batch, _) in _drain(sub) for ev in batch]
    assert evs == [["AllBlocksCleared"]]
    # the same prompt again finds nothing cached
    before = srv.engine.bm.prefix_hit_tokens
    post(srv.port, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert srv.engine.bm.prefix_hit_tokens == before


def test_replay_serves_missed_batches(srv, sub):
    post(
        srv.port, "/v1/completions", {"model": "tiny", "prompt": "Replay me " * 20, "max_tokens": 1}
    )
    live = _drain(sub)
    assert live
    first = live[0][0]
    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{srv.replay_port}")
        req.send_multipart([b"", first.to_bytes(8, "big")])
        got = []
        while req.poll(5000):
            _, seq, payload = req.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            got.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
        assert got[: len(live)] == live
    finally:
        ctx.destroy(linger=0)


def test_kv_event_sources_load_and_health_generate(srv):
    st, src = get_json(srv.port, "/kv_event_sources")
    assert st == 200 and src == [
        {
            "data_parallel_rank": 0,
            "endpoint": f"tcp://127.0.0.1:{srv.events_port}",
            "replay_endpoint": f"tcp://127.0.0.1:{srv.replay_port}",
            "topic": "kv",
        }
    ]
    st, load = get_json(srv.port, "/get_load")
    assert st == 200 and load == [
        {"dp_rank": 0, "load": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    ]
    st, h = get_json(srv.port, "/health_generate")
    assert st == 200 and h == {"status": "ok"}


def test_the_rank_header_is_checked(srv):
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1}
    st, _ = post(srv.port, "/v1/completions", body, headers={"X-data-parallel-rank": "0"})
    assert st == 200
    st, err = post(srv.port, "/v1/completions", body, headers={"X-data-parallel-rank": "1"})
    assert st == 400 and "X-data-parallel-rank" in err["error"]["message"]


def test_router_endpoints_need_the_key(srv):
    for method, path in [
        ("GET", "/get_server_info"),
        ("GET", "/get_model_info"),
        ("GET", "/get_load"),
        ("POST", "/flush_cache"),
        ("GET", "/health_generate"),
        ("POST", "/v1/completions/render"),
        ("POST", "/v1/chat/completions/render"),
        ("GET", "/kv_event_sources"),
    ]:
        st, _, _ = request(srv.port, method, path, {} if method == "POST" else None)
        assert st == 401, path
