"""The server against an attacker's requests and connections, one server
for the module (a tiny random Llama with LoRA on, runtime loading confined
to one root, short header and body timeouts): hostile adapter folders are
named 400s in well under a second while /health answers throughout; 40
loads keep the process's memory bounded and unloads free it; runtime
loading is off unless asked and stays under its roots; stored and echoed
fields are bounded (a 15 MB metadata body is a 400 at once); 500 silent
sockets leave /health answering, and slow heads and bodies get 408; the
Host header is checked; an empty API key is refused; an unknown model's
404 names no adapter."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.model_utils import make_hf_model, save_tiny_tokenizer
from tests.helpers.serve_utils import ThreadServer, get, openai_error, post

ENGINE = dict(
    num_pages=32,
    page_size=8,
    max_num_seqs=2,
    max_model_len=64,
    warmup=False,
    enable_lora=True,
    max_loras=1,
    max_lora_rank=64,
    max_cpu_loras=2,
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from checkpoints import load_config
    from jaxkv.core.engine import LLMEngine
    from jaxkv.entrypoints.openai.server import build_app
    from scripts.probe.adapters import good_adapter

    root = tmp_path_factory.mktemp("hostile")
    # Wide enough that a rank-1 adapter kept at max_lora_rank 64 would cost
    # megabytes a load (the memory test's signal).
    _, base = make_hf_model(
        "llama",
        root / "base",
        hidden_size=512,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    save_tiny_tokenizer(base)
    config = load_config(base)
    loras = root / "loras"
    good_adapter(loras, config, "good", rank=1)
    eng = LLMEngine.from_pretrained(str(base), **ENGINE)
    srv = ThreadServer(
        build_app(
            eng,
            ["tiny"],
            enable_runtime_lora_loading=True,
            lora_roots=[str(loras)],
            body_timeout=1.0,
            allowed_hosts=["127.0.0.1", "localhost"],
        ),
        header_timeout=1.0,
    )
    yield srv, root, config, eng
    srv.stop()


class Health:
    """Polls /health every 20 ms in a thread; `worst` is its slowest answer."""

    def __enter__(self):
        self.stop, self.worst, self.failed = False, 0.0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __init__(self, port):
        self.port = port

    def _run(self):
        while not self.stop:
            t0 = time.perf_counter()
            try:
                code, _ = get(self.port, "/health", timeout=5)
            except OSError:
                code = 0
            self.worst = max(self.worst, time.perf_counter() - t0)
            self.failed += code != 200
            time.sleep(0.02)

    def __exit__(self, *exc):
        self.stop = True
        self.thread.join(10)


def test_hostile_adapter_folders_are_named_400s_and_health_answers_throughout(served):
    from scripts.probe.adapters import hostile_adapters

    srv, root, config, _ = served
    cases = hostile_adapters(root / "loras" / "hostile", config)
    with Health(srv.port) as h:
        for i, (case, (folder, words)) in enumerate(cases.items()):
            t0 = time.perf_counter()
            code, body = post(
                srv.port, "/v1/load_lora_adapter", {"lora_name": f"h{i}", "lora_path": str(folder)}
            )
            took = time.perf_counter() - t0
            msg = openai_error(body, code)["message"]
            assert code == 400 and took < 1.0 and words in msg, (case, code, took, msg)
    assert h.failed == 0 and h.worst < 1.0, (h.failed, h.worst)


def test_forty_loads_keep_memory_bounded_and_unloads_free_it(served):
    srv, root, _, eng = served

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    def call(path, body) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200, r.read()
            return r.read()
        finally:
            conn.close()

    def load(name):
        call(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(root / "loras" / "good")}
        )

    for name in ("w0", "w1"):  # the first reads import and allocate what every read reuses
        load(name)
    before = rss()
    for i in range(40):
        load(f"m{i}")
    grown = rss() - before
    held = eng.loras.held_bytes()
    assert held <= 2 * eng.loras.known["m39"].weights.nbytes
    assert grown < 24 << 20, grown  # kept at rank 64, each load would keep ~1.8 MB
    for name in ["w0", "w1"] + [f"m{i}" for i in range(40)]:
        call("/v1/unload_lora_adapter", {"lora_name": name})
    assert eng.loras.held_bytes() == 0 and not eng.loras.known
    assert rss() - before < 24 << 20


def test_runtime_loading_is_off_unless_asked_and_stays_under_its_roots(served, tmp_path):
    from jaxkv.core.engine import LLMEngine
    from jaxkv.entrypoints.openai.server import build_app
    from scripts.probe.adapters import good_adapter

    srv, root, config, _ = served
    outside = good_adapter(tmp_path, config, "outside")
    code, body = post(
        srv.port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(outside)}
    )
    assert code == 403 and "--lora-root" in openai_error(body, 403)["message"]
    link = root / "loras" / "link"
    link.symlink_to(outside)  # a link inside the root to a folder outside it
    code, body = post(srv.port, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(link)})
    assert code == 403
    eng = LLMEngine.from_pretrained(str(root / "base"), **{**ENGINE, "num_pages": 8})
    off = ThreadServer(build_app(eng, ["tiny"]))
    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            code, body = post(off.port, path, {"lora_name": "x", "lora_path": str(outside)})
            assert code == 404
            assert "--enable-runtime-lora-loading" in openai_error(body, 404)["message"]
    finally:
        off.stop()


def test_stored_and_echoed_fields_are_bounded(served):
    srv = served[0]
    base = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
    huge = {"metadata": {"k": "v" * (15 << 20)}}
    t0 = time.perf_counter()
    code, body = post(srv.port, "/v1/responses", {**base, **huge})
    assert code == 400 and time.perf_counter() - t0 < 1.5
    assert "metadata" in openai_error(body, 400)["message"]
    for extra, field in (
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"text": {"format": {"type": "text", "junk": 1}}}, "text.format"),
        ({"previous_response_id": [1] * 300_000}, "previous_response_id"),
        ({"previous_response_id": "r" * 200}, "previous_response_id"),
    ):
        code, body = post(srv.port, "/v1/responses", {**base, **extra})
        err = openai_error(body, 400)
        assert code == 400 and err["param"] == field and len(json.dumps(body)) < 1000, extra
    code, body = post(srv.port, "/v1/responses", {**base, "metadata": {"user": "a" * 512}})
    assert code == 200 and body["metadata"] == {"user": "a" * 512}
    code, text = get(srv.port, "/v1/responses/" + "x" * 300)
    assert code == 400 and len(text) < 1000
    code, body = post(
        srv.port,
        "/v1/chat/completions",
        {"model": "nope" * 50_000, "messages": [{"role": "user", "content": "hi"}]},
    )
    msg = openai_error(body, 404)["message"]
    assert code == 404 and len(msg) < 700 and "good" not in msg and "tiny" in msg


def _raw(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        s.sendall(data)
    return s


def test_silent_sockets_slow_heads_and_slow_bodies(served):
    srv = served[0]
    silent = [_raw(srv.port, b"") for _ in range(500)]
    try:
        t0 = time.perf_counter()
        code, _ = get(srv.port, "/health", timeout=5)
        assert code == 200 and time.perf_counter() - t0 < 1.0
        head = _raw(srv.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never ends
        body = _raw(
            srv.port,
            b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
        )
        answer = head.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408"), answer
        answer = body.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b"request body" in answer, answer
        assert silent[0].recv(16) == b""  # closed by the server after the head's deadline
    finally:
        for s in silent:
            s.close()


def test_the_host_header_is_checked_and_an_empty_key_refused(served, capsys):
    from jaxkv.entrypoints import cli
    from jaxkv.entrypoints.openai.server import build_app

    srv, root, _, eng = served
    for host, status in (("evil.example", 400), ("localhost:1", 200), ("127.0.0.1", 200)):
        s = _raw(srv.port, f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        assert s.recv(4096).startswith(f"HTTP/1.1 {status}".encode()), host
        s.close()
    with pytest.raises(ValueError, match="api_key: empty"):
        build_app(eng, ["tiny"], api_key="")
    assert cli.main(["serve", "--model", str(root / "base"), "--api-key", ""]) == 2
    assert "--api-key: empty" in capsys.readouterr().err
