"""Helpers for the server tests: a server on 127.0.0.1 and a free port (in
a thread, or `jaxkv serve` as a subprocess), and a raw HTTP client for the
bodies the `openai` package would refuse to send."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn serving `app` from a thread, as `jaxkv serve` configures it
    (`config`: `connections.uvicorn_config`'s options); `stop()` ends it."""

    def __init__(self, app, **config):
        import uvicorn

        from jaxkv.entrypoints.openai.connections import uvicorn_config

        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, log_level="warning", **config))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextlib.contextmanager
def serving(engine, **opts):
    """A ThreadServer of `build_app(engine, ["tiny"], **opts)` for the block."""
    from jaxkv.entrypoints.openai.server import build_app

    srv = ThreadServer(build_app(engine, ["tiny"], **opts))
    try:
        yield srv
    finally:
        srv.stop()


def post(port: int, path: str, body, timeout: float = 120) -> tuple[int, dict]:
    """POST `body` (bytes sent as is, else JSON); (status, parsed JSON)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


def get(port: int, path: str, timeout: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text: str, name: str) -> float:
    """The value of the first sample of `name` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


class SSEStream:
    """A streamed completion read event by event over a raw socket, so a test
    can drop the connection mid-stream."""

    def __init__(self, port: int, path: str, body: dict, timeout: float = 120):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request(
            "POST",
            path,
            json.dumps({**body, "stream": True}).encode(),
            {"Content-Type": "application/json"},
        )
        self.resp = self.conn.getresponse()
        self.status = self.resp.status

    def events(self):
        """Parsed `data:` payloads until [DONE] (yields "[DONE]" last)."""
        while True:
            line = self.resp.readline()
            if not line:
                return
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                yield data
                return
            yield json.loads(data)

    def close(self) -> None:
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass
        self.conn.close()


def start_cli_server(model: Path, *args: str, port: int | None = None):
    """`python -m jaxkv serve` as a subprocess; returns (process, port) once
    /health answers."""
    port = port or free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxkv", "serve", "--model", str(model), "--port", str(port), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"jaxkv serve exited {proc.returncode}: {proc.stdout.read()}")
        try:
            if get(port, "/health", timeout=2)[0] == 200:
                return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("jaxkv serve did not become healthy")


@contextlib.contextmanager
def slow_steps(engine, seconds: float = 0.02):
    """Each step takes at least `seconds`, so a stream stays open a while."""
    real = engine.runner.dispatch

    def slow(*a, **k):
        time.sleep(seconds)
        return real(*a, **k)

    engine.runner.dispatch = slow
    try:
        yield
    finally:
        del engine.runner.dispatch


def request(port, method, path, body=None, headers=None, timeout=120):
    """(status, headers, parsed JSON body); the body must be JSON."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        raw = r.read()
        return r.status, dict(r.getheaders()), json.loads(raw)
    finally:
        conn.close()


def raw_exchange(port, head: bytes, chunks=(), timeout=60):
    """Send `head` and `chunks` over a bare socket; (status, parsed JSON)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        for c in chunks:
            s.sendall(c)
        r = http.client.HTTPResponse(s)
        r.begin()
        return r.status, json.loads(r.read())


def openai_error(body: dict, status: int) -> dict:
    """The error of an OpenAI-shaped error body, checked."""
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert err["code"] == status
    return err


def metrics_text(port, headers=None) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics", headers=headers or {})
        return conn.getresponse().read().decode()
    finally:
        conn.close()
