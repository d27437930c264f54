"""The HTTP part of the adversarial probe (scripts/probe/__main__.py): a `jaxkv serve` subprocess fed ~190
hostile or careless requests over plain HTTP, through its public interface only (the cases of
scripts/probe/serve_cases.py, then scripts/probe/serve_hostile.py's: adapters, bounded fields, `$ref`
schemas, grammars, the Host header, silent and slow connections).

While the probes go out (four at a time), a greedy streaming chat (the bystander) runs throughout,
restarted as it ends; each answer must equal a lone non-streaming run made before the probes.
GET /health is polled all along and must answer within 1 s. The ordinary requests among the probes
(controls) are greedy and compared with their own lone runs. After the probes the server must still
answer a control as its lone run did, answer /metrics, grow its RSS by under 1 GiB, exit 0 soon
after SIGTERM and have logged no traceback.

Outcomes (probe_common): a 4xx JSON error naming the field or problem is `named`, one that does not
`unnamed`, a 5xx or a reset `crashes`, no answer in time `hangs`, an accepted hostile request or a
control unlike its lone run `wrong`. The case table (plan_probes) and the request constants live in
scripts/probe/serve_cases.py.

    .venv/bin/python scripts/probe/serve.py [DIR]   # DIR keeps serve.log and probes.jsonl
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.probe.common import Tally, timed
from scripts.probe.serve_cases import BYSTANDER, CH, KEY, MAX_BYTES, plan_probes
from scripts.probe.serve_hostile import invalid_calls, plan_hostile, sockets

PART = "http"
TIMEOUT = 30.0


class Client:
    """One fresh HTTP/1.1 connection per call; returns (status, parsed or raw body)."""

    def __init__(self, port: int):
        self.port = port

    def call(
        self,
        method: str,
        path: str,
        body=None,
        *,
        raw: bytes | None = None,
        key: str | None = KEY,
        headers: dict | None = None,
        timeout: float = TIMEOUT,
        chunked: bool = False,
    ):
        h = {"Content-Type": "application/json"} if body is not None or raw is not None else {}
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        h.update(headers or {})
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            pieces = (
                iter([data[i : i + 65536] for i in range(0, len(data), 65536)]) if chunked else data
            )
            conn.request(method, path, body=pieces, headers=h, encode_chunked=chunked)
            r = conn.getresponse()
            out = r.read()
        finally:
            conn.close()
        try:
            return r.status, json.loads(out)
        except ValueError:
            return r.status, out

    def stream(self, path: str, body: dict, *, timeout: float = TIMEOUT) -> str:
        """The text of a streamed answer (chat deltas or completion texts); raises on an error event."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(
                "POST",
                path,
                body=json.dumps({**body, "stream": True}).encode(),
                headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
            )
            r = conn.getresponse()
            if r.status != 200:
                raise RuntimeError(f"stream status {r.status}: {r.read()[:300]!r}")
            text = []
            for line in (x.strip() for x in r if x.startswith(b"data: ")):
                if line == b"data: [DONE]":
                    return "".join(text)
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise RuntimeError(f"error event: {ev['error']}")
                text += [
                    ch.get("delta", {}).get("content") or ch.get("text") or ""
                    for ch in ev.get("choices", [])
                ]
            raise ConnectionError("stream ended without [DONE]")
        finally:
            conn.close()


def texts(resp) -> list[str] | None:
    """The choices' texts of a completion / chat answer (a chat choice's tool calls as their JSON;
    tokenize's tokens as one string)."""
    if isinstance(resp, dict) and ("tokens" in resp or "prompt" in resp):
        return [json.dumps(resp.get("tokens", resp.get("prompt")))]
    if not isinstance(ch := resp.get("choices") if isinstance(resp, dict) else None, list):
        return None
    return [
        c.get("text")
        if "text" in c
        else json.dumps([t["function"] for t in c["message"]["tool_calls"]])
        if (c.get("message") or {}).get("tool_calls")
        else (c.get("message") or {}).get("content")
        for c in ch
    ]


def judge(status, resp, words, expect: str, lone=None) -> tuple[str, str]:
    """(outcome, detail) of one answer; expect: 'err' (a named 4xx), 'ok' (200 equal to `lone`) or 'either'."""
    detail = (
        f"{status}: {json.dumps(resp)[:240] if isinstance(resp, (dict, list)) else resp[:240]!r}"
    )
    if status >= 500:
        return "crashes", detail
    if status == 200:
        if expect == "err":
            return "wrong", "accepted: " + detail
        got = texts(resp)
        return (
            ("served", detail)
            if got is not None and got == lone
            else ("wrong", f"lone {lone!r} vs {detail}")
        )
    if expect == "ok":
        return "wrong", "refused a control: " + detail
    err = resp.get("error") if isinstance(resp, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return "unnamed", "not OpenAI error JSON: " + detail
    said = (err["message"] + " " + str(err.get("param") or "")).lower()
    return ("named", detail) if any(w.lower() in said for w in words) else ("unnamed", detail)


def send(client: Client, probe, lone: dict) -> tuple[str, str]:
    """Send one probe and judge its answer: (outcome, detail)."""
    case, method, path, body, kw, words, expect = probe
    try:
        if path == "/metrics" and expect == "ok":  # Prometheus text
            status, resp = client.call(method, path, **kw)
            return (
                "served" if status == 200 and b"# TYPE" in resp else "crashes"
            ), f"{status}: {resp[:200]!r}"
        if method in ("SILENT", "SLOWHEAD", "SLOWBODY"):
            return sockets(client.port, method)
        if case.startswith("tools: forced"):
            status, resp = client.call(method, path, body, **kw)
            outcome, detail = judge(status, resp, words, expect, lone.get(case))
            why = invalid_calls(body, resp) if outcome == "served" else None
            return ("wrong", f"arguments break the schema: {why}") if why else (outcome, detail)
        if method == "STREAM":
            got = client.stream(path, body)
            return (
                ("served", got)
                if [got] == lone[case]
                else ("wrong", f"lone {lone[case]!r} vs {got!r}")
            )
        if method in ("CUT", "HALF"):
            with socket.create_connection(("127.0.0.1", client.port), timeout=TIMEOUT) as s:
                data = json.dumps({**body, "stream": method == "CUT"}).encode()
                head = (
                    f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                ).encode()
                s.sendall(head + (data if method == "CUT" else data[: len(data) // 2]))
                first = s.recv(4096) if method == "CUT" else b""
            if method == "CUT" and not first.startswith(b"HTTP/1.1 200"):
                return "crashes", f"stream opened with {first[:200]!r}"
            t0 = time.monotonic()
            status, _ = client.call("GET", "/health", timeout=2.0)
            if status != 200:
                return "crashes", f"/health {status} after the client left"
            return "served", f"health after {time.monotonic() - t0:.2f}s"
        status, resp = client.call(method, path, body, **kw)
        return judge(status, resp, words, expect, lone.get(case))
    except Exception as e:  # noqa: BLE001 - every failure is classified
        return failure(e), f"{type(e).__name__}: {e}"


def failure(e: Exception) -> str:
    """No answer in time: hangs; a stream cut short: lost; a reset, a refused connection, an error event: crashes."""
    return (
        "hangs"
        if isinstance(e, TimeoutError)
        else "lost"
        if isinstance(e, ConnectionError) and str(e).startswith("stream ended")
        else "crashes"
    )


def vocab_size(client: Client) -> int:
    """The model's vocabulary size, found by bisecting on what /detokenize accepts."""
    lo, hi = 0, 1 << 24  # lo is a token id, hi is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (
            (mid, hi)
            if client.call("POST", "/detokenize", {"tokens": [mid]})[0] == 200
            else (lo, mid)
        )
    return hi


def rss(pid: int) -> int:
    """The resident memory of process `pid` in bytes."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        line = next(
            x
            for x in Path(f"/proc/{pid}/status").read_text().splitlines()
            if x.startswith("VmRSS:")
        )
        return int(line.split()[1]) * 1024


def run(tally: Tally, root: Path, model: Path, *, probes: int = 130) -> None:
    """The http part: serve `model`, probe it (at most `probes` requests of the first table, then
    probe_http_hostile's), shut it down."""
    with timed(tally, PART):
        _run(tally, Path(root), Path(model), probes)


def _run(tally: Tally, root: Path, model: Path, limit: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "serve.log", "wb")  # noqa: SIM115 - closed in the finally
    from checkpoints import load_config

    loras = root / "loras"
    hostile = plan_hostile(loras, load_config(model))
    cmd = [
        sys.executable,
        "-m",
        "jaxkv",
        "serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--no-warmup",
        "--max-num-seqs",
        "8",
        "--num-pages",
        "256",
        "--page-size",
        "16",
        "--max-request-bytes",
        str(MAX_BYTES),
        "--shutdown-timeout",
        "20",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--enable-runtime-lora-loading",
        "--lora-root",
        str(loras),
        "--header-timeout",
        "2",
        "--body-timeout",
        "2",
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    client, stop = Client(port), threading.Event()
    try:
        for _ in range(240):  # up to 120 s for /health
            with contextlib.suppress(OSError):
                if proc.poll() is not None or client.call("GET", "/health", timeout=2.0)[0] == 200:
                    break
            time.sleep(0.5)
        if proc.poll() is not None or client.call("GET", "/health", timeout=2.0)[0] != 200:
            tally.add(
                PART,
                "crashes" if proc.poll() is not None else "hangs",
                "start",
                f"rc {proc.poll()}; see {root / 'serve.log'}",
            )
            return
        plan = plan_probes(vocab_size(client))[:limit] + hostile
        lone: dict[str, list] = {}
        for (
            case,
            method,
            path,
            body,
            _,
            _,
            expect,
        ) in plan:  # lone runs of the controls, one at a time
            if expect != "err" and method in ("POST", "STREAM"):
                lone[case] = texts(client.call("POST", path, body)[1])
        bystander_lone = texts(client.call("POST", CH, BYSTANDER)[1])
        lone["final control"] = bystander_lone
        rss0 = rss(proc.pid)

        def bystander():
            for _ in range(60):
                if stop.is_set():
                    return
                try:
                    got = client.stream(CH, BYSTANDER, timeout=60)
                    tally.add(
                        PART,
                        "served" if [got] == bystander_lone else "wrong",
                        "bystander",
                        f"lone {bystander_lone!r} vs streamed {got!r}",
                    )
                except Exception as e:  # noqa: BLE001 - every failure is classified
                    tally.add(PART, failure(e), "bystander", repr(e))

        slow: list[str] = []

        def health():
            for _ in range(3000):  # every 0.5 s, each answer within 1 s
                if stop.wait(0.5):
                    return
                try:
                    t0 = time.monotonic()
                    status, _ = client.call("GET", "/health", timeout=2.0)
                    took = time.monotonic() - t0
                    slow.extend(
                        [f"status {status}"]
                        if status != 200
                        else [f"answered in {took:.2f} s"]
                        if took > 1.0
                        else []
                    )
                except OSError as e:
                    slow.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=f, daemon=True) for f in (bystander, health)]
        for t in threads:
            t.start()
        with ThreadPoolExecutor(4) as pool, open(root / "probes.jsonl", "w") as record:
            for probe, (outcome, detail) in zip(
                plan, pool.map(lambda p: send(client, p, lone), plan), strict=True
            ):
                tally.add(PART, outcome, probe[0], detail)
                record.write(
                    json.dumps({"case": probe[0], "outcome": outcome, "detail": detail}) + "\n"
                )
        stop.set()
        for t in threads:
            t.join(timeout=90)
        for s in slow[:10] or [None]:
            tally.add(PART, "hangs" if s else "served", "health", s or "")
        if proc.poll() is not None:
            tally.add(
                PART, "crashes", "alive", f"server exited rc {proc.returncode} during the probes"
            )
            return
        for case, method, path, body in (
            ("final control", "POST", CH, BYSTANDER),
            ("metrics", "GET", "/metrics", {}),
        ):
            outcome, detail = send(client, (case, method, path, body, {}, (), "ok"), lone)
            tally.add(PART, outcome, case, detail)
        grown = rss(proc.pid) - rss0
        tally.add(
            PART, "memory" if grown > 1 << 30 else "served", "rss", f"grew {grown / 2**20:.0f} MiB"
        )
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=40)
            tally.add(PART, "served" if rc == 0 else "crashes", "sigterm", f"rc {rc}")
        except subprocess.TimeoutExpired:
            tally.add(PART, "hangs", "sigterm", "still running 40 s after SIGTERM")
        tb = (root / "serve.log").read_text(errors="replace").split("Traceback")[1:]
        tally.add(
            PART,
            "crashes" if tb else "served",
            "server log",
            f"{len(tb)} tracebacks, first: {tb[:1]}",
        )
    except Exception as e:  # noqa: BLE001 - a lone run or a final check failed: the server's doing
        tally.add(PART, failure(e), "run", f"{type(e).__name__}: {e}")
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


if __name__ == "__main__":
    from scripts.probe.common import make_tiny_model

    t0, tally = time.time(), Tally()
    with (
        tempfile.TemporaryDirectory() as d
    ):  # argv[1]: a folder to keep serve.log and probes.jsonl in
        out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(d)
        run(tally, out, make_tiny_model(Path(d) / "tiny"))
    print(tally.table(), *tally.failures, f"wall {time.time() - t0:.0f} s", sep="\n")
    sys.exit(1 if tally.bad() else 0)
