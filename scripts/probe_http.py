"""The HTTP part of the adversarial probe (scripts/probe.py): a `jaxkv serve` subprocess fed ~130
hostile or careless requests over plain HTTP, through its public interface only.

While the probes go out (four at a time), a greedy streaming chat (the bystander) runs throughout,
restarted as it ends; each answer must equal a lone non-streaming run made before the probes.
GET /health is polled all along and must answer within 2 s. The ordinary requests among the probes
(controls) are greedy and compared with their own lone runs. After the probes the server must still
answer a control as its lone run did, answer /metrics, grow its RSS by under 1 GiB, exit 0 soon
after SIGTERM and have logged no traceback.

Outcomes (probe_common): a 4xx JSON error naming the field or problem is `named`, one that does not
`unnamed`, a 5xx or a reset `crashes`, no answer in time `hangs`, an accepted hostile request or a
control unlike its lone run `wrong`.

    .venv/bin/python scripts/probe_http.py [DIR]   # DIR keeps serve.log and probes.jsonl
"""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from probe_common import Tally, timed

PART = "http"
KEY = "probe-key"
TIMEOUT = 30.0
MAX_BYTES = 1 << 20
C, CH = "/v1/completions", "/v1/chat/completions"
GREEDY = {"temperature": 0, "max_tokens": 8}
BYSTANDER = {"messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
             "temperature": 0, "max_tokens": 64, "ignore_eos": True}


class Client:
    """One fresh HTTP/1.1 connection per call; returns (status, parsed or raw body)."""

    def __init__(self, port: int):
        self.port = port

    def call(self, method: str, path: str, body=None, *, raw: bytes | None = None, key: str | None = KEY,
             headers: dict | None = None, timeout: float = TIMEOUT, chunked: bool = False):
        h = {"Content-Type": "application/json"} if body is not None or raw is not None else {}
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        h.update(headers or {})
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            pieces = iter([data[i:i + 65536] for i in range(0, len(data), 65536)]) if chunked else data
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
            conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
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
                text += [ch.get("delta", {}).get("content") or ch.get("text") or "" for ch in ev.get("choices", [])]
            raise ConnectionError("stream ended without [DONE]")
        finally:
            conn.close()


def texts(resp) -> list[str] | None:
    """The choices' texts of a completion / chat answer (or tokenize's tokens as one string)."""
    if isinstance(resp, dict) and ("tokens" in resp or "prompt" in resp):
        return [json.dumps(resp.get("tokens", resp.get("prompt")))]
    if not isinstance(ch := resp.get("choices") if isinstance(resp, dict) else None, list):
        return None
    return [c.get("text") if "text" in c else (c.get("message") or {}).get("content") for c in ch]


def judge(status, resp, words, expect: str, lone=None) -> tuple[str, str]:
    """(outcome, detail) of one answer; expect: 'err' (a named 4xx), 'ok' (200 equal to `lone`) or 'either'."""
    detail = f"{status}: {json.dumps(resp)[:240] if isinstance(resp, (dict, list)) else resp[:240]!r}"
    if status >= 500:
        return "crashes", detail
    if status == 200:
        if expect == "err":
            return "wrong", "accepted: " + detail
        got = texts(resp)
        return ("served", detail) if got is not None and got == lone else ("wrong", f"lone {lone!r} vs {detail}")
    if expect == "ok":
        return "wrong", "refused a control: " + detail
    err = resp.get("error") if isinstance(resp, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return "unnamed", "not OpenAI error JSON: " + detail
    said = (err["message"] + " " + str(err.get("param") or "")).lower()
    return ("named", detail) if any(w.lower() in said for w in words) else ("unnamed", detail)


def plan_probes(vocab: int) -> list[tuple]:
    """(case, method, path, body | None, extra call kwargs, words named, expect)."""
    P = {"prompt": "Hello there", "max_tokens": 4}
    M = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out: list[tuple] = []

    def err(case, path, body, *words, method="POST", **kw):
        out.append((case, method, path, body, kw, words or (case.split(":")[0],), "err"))

    def ok(case, path, body, expect="ok", *words, **kw):
        out.append((case, "POST", path, {**GREEDY, **body} if path in (C, CH) else body, kw, words, expect))

    auth = ("authorization", "api key")
    for path, method in ((C, "POST"), (CH, "POST"), ("/v1/models", "GET"), ("/metrics", "GET"),
                         ("/tokenize", "POST"), ("/detokenize", "POST")):
        err(f"no key {path}", path, P if method == "POST" else None, *auth, method=method, key=None)
    err(f"wrong key {C}", C, P, *auth, key="nope")
    err(f"basic auth {CH}", CH, M, *auth, key=None, headers={"Authorization": f"Basic {KEY}"})
    shapes = {"bad json": b'{"prompt": "hi",', "array": b"[1, 2]", "string": b'"hi"', "null": b"null",
              "empty": b"", "bad utf8": b'{"prompt": "\xff\xfe"}'}
    for path in (C, CH, "/tokenize", "/detokenize"):
        for name, raw in list(shapes.items())[:{C: 6, CH: 4}.get(path, 2)]:
            err(f"{name} {path}", path, None, "request body", "json", "object", raw=raw)
    err(f"NaN {C}", C, None, "temperature", raw=b'{"prompt": "hi", "temperature": NaN}')
    err(f"Infinity {CH}", CH, None, "top_p", raw=json.dumps({**M, "top_p": float("inf")}).encode())
    err("prompt: missing", C, {"max_tokens": 4})
    err("messages: missing", CH, {"max_tokens": 4})
    err("prompt: empty", C, {**P, "prompt": ""})
    bad = {"max_tokens": [-1, "abc", 1e30], "temperature": ["NaN", "abc", -1], "top_p": [2, -0.5], "top_k": [-5],
           "min_p": [2], "presence_penalty": [1e9], "frequency_penalty": ["x"], "repetition_penalty": [0],
           "n": [0, 1000], "stop": [{"a": 1}, [1, 2]], "stop_token_ids": [[-1]],
           "logit_bias": [{"²": 1}, {"1": 1e30}, {str(vocab + 5): 1}], "seed": ["x"], "logprobs": [1000],
           "ignore_eos": ["yes"], "min_tokens": [100], "allowed_token_ids": [[]],
           "bad_words": [[""]], "prompt_logprobs": [1000], "stream": ["yes"], "echo": ["yes"], "best_of": [3],
           "suffix": ["x"]}
    for field, values in bad.items():
        for v in values:
            err(f"{field}: {v!r}"[:60], C, {**P, field: v}, field)
    err("stream_options without stream", C, {**P, "stream_options": {"include_usage": True}}, "stream_options")
    err("max_completion_tokens: 'x'", CH, {**M, "max_completion_tokens": "x"}, "max_completion_tokens")
    err("logprobs: 'yes' chat", CH, {**M, "logprobs": "yes"}, "logprobs")
    err("top_logprobs: 1000", CH, {**M, "logprobs": True, "top_logprobs": 1000}, "top_logprobs", "logprobs")
    err("top_logprobs without logprobs", CH, {**M, "top_logprobs": 2}, "top_logprobs")
    err("tools", CH, {**M, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools")
    err("tool_choice: auto", CH, {**M, "tool_choice": "auto"}, "tool_choice")
    err("model: unknown", C, {**P, "model": "gpt-5"}, "model")
    err("prompt: nested 200 deep", C, {**P, "prompt": json.loads("[" * 200 + "1" + "]" * 200)}, "prompt")
    err("prompt: 1000 prompts", C, {**P, "prompt": ["hi"] * 1000}, "prompt")
    err("prompt: mixed ids", C, {**P, "prompt": [[1, 2], [3, "a"]]}, "prompt")
    err("prompt: negative id", C, {**P, "prompt": [-1, 5]}, "prompt", "token")
    err("prompt: id beyond vocab", C, {**P, "prompt": [10 ** 9]}, "prompt", "token")
    err("prompt: longer than max len", C, {**P, "prompt": "hello " * 5000}, "prompt", "model length")
    err("prompt: 3000 ids", C, {**P, "prompt": [5] * 3000}, "prompt", "model length")
    err("max_tokens: beyond max len", C, {**P, "max_tokens": 100000}, "max_tokens", "model length")
    err("json nested 5000 deep", C, None, "nested", "json", raw=b"[" * 5000 + b"]" * 5000)
    err("prompt nested 5000 deep", C, None, "nested", "json", raw=b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    big = json.dumps({**P, "prompt": "x" * (MAX_BYTES + 10)}).encode()
    err("413 content-length", C, None, "bytes", "max-request-bytes", raw=big)
    err("413 chunked", C, None, "bytes", "max-request-bytes", raw=big, chunked=True)
    err("413 huge content-length", C, None, "bytes", raw=b"{}", headers={"Content-Length": str(10 ** 12)})
    err("form body", C, None, "json", "request body", raw=b"prompt=hi",
        headers={"Content-Type": "application/x-www-form-urlencoded"})
    err("prompt: lone surrogate", C, None, "surrogate", "unicode", "prompt", raw=b'{"prompt": "a\\ud800b"}')
    err("messages: lone surrogate", CH, None, "surrogate", "unicode", "messages",
        raw=b'{"messages": [{"role": "user", "content": "\\udfff"}]}')
    err("stop: lone surrogate", C, None, "surrogate", "unicode", "stop", raw=b'{"prompt": "hi", "stop": "\\ud800"}')
    err("tokenize: lone surrogate", "/tokenize", None, "surrogate", "unicode", "prompt", raw=b'{"prompt": "\\ud800"}')
    err("messages: empty", CH, {**M, "messages": []}, "messages")
    err("messages: role number", CH, {**M, "messages": [{"role": 5, "content": "hi"}]}, "role", "messages")
    err("messages: not objects", CH, {**M, "messages": ["hi"]}, "messages")
    err("messages: content number", CH, {**M, "messages": [{"role": "user", "content": 5}]}, "content", "messages")
    err("messages: image part", CH, {**M, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "content", "text parts")
    err("messages: unknown part", CH, {**M, "messages": [{"role": "user", "content": [{"type": "blob"}]}]}, "content")
    err("chat_template_kwargs: list", CH, {**M, "chat_template_kwargs": [1]}, "chat_template_kwargs")
    so_words = ("response_format", "schema", "json", "structured", "regex", "choice", "grammar")
    err("response_format: bad schema", CH, {**M, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frobnicate"}}}}, *so_words)
    err("response_format: type xml", CH, {**M, "response_format": {"type": "xml"}}, *so_words)
    err("response_format: schema list", CH, {**M, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": [1]}}}, *so_words)
    err("guided_regex: (((", C, {**P, "guided_regex": "((("}, *so_words)
    err("guided_choice: []", C, {**P, "guided_choice": []}, *so_words)
    err("structured_outputs: string", C, {**P, "structured_outputs": "x"}, *so_words)
    err("two structured fields", C, {**P, "guided_regex": "a+", "guided_choice": ["a"]}, *so_words)
    ok("guided_choice: 40000 choices", C, {**P, "guided_choice": [f"c{i:06d}" for i in range(40000)]}, "either",
       "choice")
    for path in ("/v1/nope", "/%2e%2e/etc/passwd"):
        err(f"404 {path}", path, P, "not found")
    for method, path in (("GET", C), ("PUT", CH), ("POST", "/health")):
        err(f"405 {method} {path}", path, P if method != "GET" else None, "method", method=method)
    for v in ([-1], [vocab], [10 ** 30], ["a"], "abc"):
        err(f"detokenize: {v!r}", "/detokenize", {"tokens": v}, "tokens")
    err("tokenize: prompt number", "/tokenize", {"prompt": 5}, "prompt")
    err("tokenize: add_special_tokens", "/tokenize", {"prompt": "hi", "add_special_tokens": "x"}, "add_special_tokens")
    ok("tokenize: ok", "/tokenize", {"prompt": "Hello there"})
    ok("detokenize: ok", "/detokenize", {"tokens": [1, 2, 3, 100]})
    for n in (2, 3, 5, 7):
        ok(f"n={n}", C, {**P, "n": n})
    ok("chat", CH, M)
    ok("text/plain content type", C, P, "either", "content-type", headers={"Content-Type": "text/plain"})
    ok("no content type", C, P, "either", "content-type", headers={"Content-Type": ""})
    ok("unicode emoji rtl nul", C, {**P, "prompt": "héllo 👩‍👩‍👧 שלום \u200b\u0000 end"})
    ok("seed 2**70 sampled", C, {**P, "temperature": 1.0, "seed": 2 ** 70}, "either", "seed")
    ok("prompt ids", C, {**P, "prompt": [1, 2, 3]})
    ok("role wizard", CH, {**M, "messages": [{"role": "wizard", "content": "hi"}]}, "either", "role", "messages")
    ok("unknown fields", C, {**P, **{f"junk{i}": i for i in range(2000)}})
    out.append(("stream control", "STREAM", C, {**GREEDY, **P}, {}, (), "ok"))
    for i in range(2):
        out.append((f"disconnect mid-stream {i}", "CUT", CH if i % 2 else C,
                    {**BYSTANDER, "max_tokens": 400, "prompt": "Once"}, {}, (), "ok"))
    out.append(("disconnect mid-body", "HALF", C, P, {}, (), "ok"))
    random.Random(0).shuffle(out)  # controls among the hostile ones
    return out


def send(client: Client, probe, lone: dict) -> tuple[str, str]:
    """Send one probe and judge its answer: (outcome, detail)."""
    case, method, path, body, kw, words, expect = probe
    try:
        if path == "/metrics" and expect == "ok":  # Prometheus text
            status, resp = client.call(method, path, **kw)
            return ("served" if status == 200 and b"# TYPE" in resp else "crashes"), f"{status}: {resp[:200]!r}"
        if method == "STREAM":
            got = client.stream(path, body)
            return ("served", got) if [got] == lone[case] else ("wrong", f"lone {lone[case]!r} vs {got!r}")
        if method in ("CUT", "HALF"):
            with socket.create_connection(("127.0.0.1", client.port), timeout=TIMEOUT) as s:
                data = json.dumps({**body, "stream": method == "CUT"}).encode()
                head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
                s.sendall(head + (data if method == "CUT" else data[:len(data) // 2]))
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
    return "hangs" if isinstance(e, TimeoutError) else "lost" if isinstance(e, ConnectionError) and str(
        e).startswith("stream ended") else "crashes"


def vocab_size(client: Client) -> int:
    """The model's vocabulary size, found by bisecting on what /detokenize accepts."""
    lo, hi = 0, 1 << 24  # lo is a token id, hi is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if client.call("POST", "/detokenize", {"tokens": [mid]})[0] == 200 else (lo, mid)
    return hi


def rss(pid: int) -> int:
    """The resident memory of process `pid` in bytes."""
    try:
        import psutil
        return psutil.Process(pid).memory_info().rss
    except ImportError:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024


def run(tally: Tally, root: Path, model: Path, *, probes: int = 130) -> None:
    """The http part: serve `model`, probe it (at most `probes` requests), shut it down."""
    with timed(tally, PART):
        _run(tally, Path(root), Path(model), probes)


def _run(tally: Tally, root: Path, model: Path, limit: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "serve.log", "wb")  # noqa: SIM115 - closed in the finally
    cmd = [sys.executable, "-m", "jaxkv", "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--api-key", KEY, "--no-warmup", "--max-num-seqs", "8", "--num-pages", "256", "--page-size", "16",
           "--max-request-bytes", str(MAX_BYTES), "--shutdown-timeout", "20"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    client, stop = Client(port), threading.Event()
    try:
        for _ in range(240):  # up to 120 s for /health
            with contextlib.suppress(OSError):
                if proc.poll() is not None or client.call("GET", "/health", timeout=2.0)[0] == 200:
                    break
            time.sleep(0.5)
        if proc.poll() is not None or client.call("GET", "/health", timeout=2.0)[0] != 200:
            tally.add(PART, "crashes" if proc.poll() is not None else "hangs", "start",
                      f"rc {proc.poll()}; see {root / 'serve.log'}")
            return
        plan = plan_probes(vocab_size(client))[:limit]
        lone: dict[str, list] = {}
        for case, method, path, body, _, _, expect in plan:  # lone runs of the controls, one at a time
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
                    tally.add(PART, "served" if [got] == bystander_lone else "wrong", "bystander",
                              f"lone {bystander_lone!r} vs streamed {got!r}")
                except Exception as e:  # noqa: BLE001 - every failure is classified
                    tally.add(PART, failure(e), "bystander", repr(e))

        slow: list[str] = []

        def health():
            for _ in range(3000):  # every 0.5 s, each answer within 2 s
                if stop.wait(0.5):
                    return
                try:
                    status, _ = client.call("GET", "/health", timeout=2.0)
                    slow.extend([f"status {status}"] if status != 200 else [])
                except OSError as e:
                    slow.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=f, daemon=True) for f in (bystander, health)]
        for t in threads:
            t.start()
        with ThreadPoolExecutor(4) as pool, open(root / "probes.jsonl", "w") as record:
            for probe, (outcome, detail) in zip(plan, pool.map(lambda p: send(client, p, lone), plan), strict=True):
                tally.add(PART, outcome, probe[0], detail)
                record.write(json.dumps({"case": probe[0], "outcome": outcome, "detail": detail}) + "\n")
        stop.set()
        for t in threads:
            t.join(timeout=90)
        for s in slow[:10] or [None]:
            tally.add(PART, "hangs" if s else "served", "health", s or "")
        if proc.poll() is not None:
            tally.add(PART, "crashes", "alive", f"server exited rc {proc.returncode} during the probes")
            return
        for case, method, path, body in (("final control", "POST", CH, BYSTANDER), ("metrics", "GET", "/metrics", {})):
            outcome, detail = send(client, (case, method, path, body, {}, (), "ok"), lone)
            tally.add(PART, outcome, case, detail)
        grown = rss(proc.pid) - rss0
        tally.add(PART, "memory" if grown > 1 << 30 else "served", "rss", f"grew {grown / 2 ** 20:.0f} MiB")
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=40)
            tally.add(PART, "served" if rc == 0 else "crashes", "sigterm", f"rc {rc}")
        except subprocess.TimeoutExpired:
            tally.add(PART, "hangs", "sigterm", "still running 40 s after SIGTERM")
        tb = (root / "serve.log").read_text(errors="replace").split("Traceback")[1:]
        tally.add(PART, "crashes" if tb else "served", "server log", f"{len(tb)} tracebacks, first: {tb[:1]}")
    except Exception as e:  # noqa: BLE001 - a lone run or a final check failed: the server's doing
        tally.add(PART, failure(e), "run", f"{type(e).__name__}: {e}")
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from probe_common import make_tiny_model

    t0, tally = time.time(), Tally()
    with tempfile.TemporaryDirectory() as d:  # argv[1]: a folder to keep serve.log and probes.jsonl in
        out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(d)
        run(tally, out, make_tiny_model(Path(d) / "tiny"))
    print(tally.table(), *tally.failures, f"wall {time.time() - t0:.0f} s", sep="\n")
    sys.exit(1 if tally.bad() else 0)
