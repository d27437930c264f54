"""Prefill/decode disaggregation, in the shape sglang-router drives
(`--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL`): the
router sends each request to both servers with `bootstrap_host`,
`bootstrap_port` and `bootstrap_room`.

- The prefill server (`--disaggregation-mode prefill`) runs the prompt with
  one output token, copies the prompt's full pages off the device and keeps
  them for the room. Its bootstrap server (a TCP port) hands them to the
  decode server that asks for that room, waiting for them while the prefill
  runs; pages nobody collects are dropped after `room_timeout` s.
- The decode server (`--disaggregation-mode decode`) renders the prompt
  itself, asks the prefill's bootstrap server for the pages of its prompt
  (named by the pools' chained hashes), puts them in its host tier and runs
  the request: the pages load as host hits, so it computes only the prompt's
  last, partial page (1 to page_size tokens, the last token always) and
  decodes. Pages that do not come within `transfer_timeout` s, or a prefill
  side that goes away mid-transfer, end the request with a named error;
  nothing is put in the pool before the whole transfer checked out.

Frames are the disk tier's checksummed page format (`disk.encode_page`):
the engine's fingerprint (model, weights digest, KV layout) must match on
both sides, and the MAC is keyed by $JAXKV_KV_TRANSFER_KEY when set (the
same on both sides; unset: a plain checksum, for trusted networks). JAX's
own transfer server (`jax.experimental.transfer`) is not used yet: it needs
an accelerator, and none was at hand to test it.

Wire protocol on the bootstrap port: the decode side sends one JSON line
{"room", "fingerprint", "hashes": [hex, ...], "mac"}; the prefill side
answers one JSON line, {"pages": n, "page_bytes": b} or {"error": text},
then n frames of (16-byte page hash, encoded page).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import socket
import socketserver
import threading
import time

import numpy as np

from jaxkv.core.kv.disk import decode_page, encode_page, page_bytes
from jaxkv.core.scheduling.page_pool import hash_page, salted_root
from jaxkv.entrypoints.openai.protocol import APIError

log = logging.getLogger("jaxkv.serve")

MODES = ("null", "prefill", "decode")
FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
HASH = 16  # bytes of a page hash


class HandoffError(RuntimeError):
    """A transfer that did not complete; the message says why."""


def transfer_key() -> bytes:
    return os.environ.get("JAXKV_KV_TRANSFER_KEY", "").encode()[:64]


class PageFormat:
    """The engine's pages as frames: its paged leaves' layout and fingerprint."""

    def __init__(self, engine):
        from flax import nnx

        from jaxkv.core.kv.disk import fingerprint
        from jaxkv.model.kv_cache import paged_leaves

        r = engine.runner
        leaves = paged_leaves(r.cache)
        self.layout = [((x.shape[0],) + tuple(x.shape[2:]), np.dtype(x.dtype)) for x in leaves]
        scales = [np.asarray(x) for x in r.cache.k_scale + r.cache.v_scale] if r.cache.fp8 else None
        self.fp = fingerprint(
            nnx.merge(r.graphdef, r.state),
            [(s, str(d)) for s, d in self.layout],
            engine.cache_config.kv_dtype,
            engine.config.page_size,
            scales,
        ).encode()
        self.key = transfer_key()
        self.size = page_bytes(self.layout, self.fp)

    def mac(self, room: int) -> str:
        return hmac.new(self.key or b"-", b"%d:" % room + self.fp, hashlib.sha256).hexdigest()


@dataclasses.dataclass
class Room:
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    pages: dict | None = None  # hash -> encoded page
    error: str | None = None
    born: float = dataclasses.field(default_factory=time.monotonic)


class Rooms:
    """The prefill side's pages per room, until collected or too old."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._rooms: dict[int, Room] = {}
        self._lock = threading.Lock()
        self.expired = 0  # rooms dropped uncollected

    def get(self, room: int) -> Room:
        with self._lock:
            return self._rooms.setdefault(room, Room())

    def put(self, room: int, pages: dict | None, error: str | None = None) -> None:
        r = self.get(room)
        r.pages, r.error = pages, error
        r.ready.set()

    def take(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def sweep(self) -> int:
        now = time.monotonic()
        with self._lock:
            old = [k for k, r in self._rooms.items() if now - r.born > self.timeout]
            for k in old:
                del self._rooms[k]
        self.expired += len(old)
        return len(old)

    def __len__(self) -> int:
        return len(self._rooms)

    def __contains__(self, room: int) -> bool:
        return room in self._rooms


def fetch(host: str, port: int, room: int, hashes: list[bytes], fmt: PageFormat, timeout: float):
    """The pages of `hashes` (a leading run) from the prefill side of `room`:
    ([(hash, arrays)], seconds on the wire). HandoffError naming what failed."""
    ask = {"room": room, "fingerprint": fmt.fp.decode(), "hashes": [h.hex() for h in hashes]}
    ask["mac"] = fmt.mac(room)
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise HandoffError(f"prefill side {host}:{port} not reachable ({e})") from None
    with s, s.makefile("rb") as f:
        try:
            s.sendall(json.dumps(ask).encode() + b"\n")
            head = f.readline(65536)
        except OSError as e:  # a timeout too
            raise HandoffError(f"prefill side {host}:{port} did not answer ({e})") from None
        if not head:
            raise HandoffError(f"prefill side {host}:{port} closed before answering")
        t0 = time.perf_counter()
        try:
            head = json.loads(head)
        except json.JSONDecodeError:
            raise HandoffError("prefill side answered something that is not JSON") from None
        if "error" in head:
            raise HandoffError(f"prefill side: {head['error']}")
        n, size = int(head["pages"]), int(head["page_bytes"])
        if size != fmt.size or n > len(hashes):
            raise HandoffError(
                f"prefill side sends {n} pages of {size} bytes; asked for at most "
                f"{len(hashes)} of {fmt.size}"
            )
        out = []
        for i in range(n):
            try:
                blob = f.read(HASH + size)
            except OSError:
                blob = b""
            if len(blob) != HASH + size:
                raise HandoffError(f"prefill side closed the transfer after {i} of {n} pages")
            if blob[:HASH] != hashes[i]:
                raise HandoffError(f"prefill side sent page {i} for another prompt")
            try:
                out.append((hashes[i], decode_page(blob[HASH:], fmt.layout, fmt.fp, fmt.key)))
            except ValueError as e:
                raise HandoffError(f"page {i} refused: {e}") from None
    return out, time.perf_counter() - t0


class _Bootstrap(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class Handoff:
    """One server's side of the split (`mode` prefill or decode)."""

    def __init__(
        self,
        engine,
        mode: str,
        metrics,
        *,
        host: str = "127.0.0.1",
        bootstrap_port: int = 8998,
        transfer_timeout: float = 30.0,
        room_timeout: float = 60.0,
    ):
        if mode not in ("prefill", "decode"):
            raise ValueError(f"disaggregation_mode: one of {', '.join(MODES)}, got {mode!r}")
        if mode == "decode" and engine.tier is None:
            raise ValueError(
                "disaggregation_mode decode: the engine needs a host tier to take the "
                "prefill's pages (set kv_offload_memory)"
            )
        self.engine, self.mode, self.metrics = engine, mode, metrics
        self.host, self.port = host, bootstrap_port
        self.transfer_timeout = transfer_timeout
        self.fmt = PageFormat(engine)
        self.rooms = Rooms(room_timeout)
        self._server = None
        self._stop = threading.Event()

    # ---------------------------------------------------------- lifetime

    def start(self) -> None:
        if self.mode != "prefill":
            return
        handoff = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self):
                handoff._serve_one(self.rfile, self.wfile)

        self._server = _Bootstrap((self.host, self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        threading.Thread(target=self._sweep, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _sweep(self) -> None:
        while not self._stop.wait(0.5):
            n = self.rooms.sweep()
            if n:
                log.warning("jaxkv serve: %d prefill rooms dropped, never collected", n)

    # --------------------------------------------------------- prefill side

    def _serve_one(self, rfile, wfile) -> None:
        def answer(obj):
            wfile.write(json.dumps(obj).encode() + b"\n")

        try:
            ask = json.loads(rfile.readline(1 << 22))
            room = int(ask["room"])
            want = [bytes.fromhex(h) for h in ask["hashes"]]
        except (ValueError, KeyError, TypeError):
            return answer({"error": "a bootstrap request is one JSON line: room, hashes, mac"})
        if ask.get("fingerprint") != self.fmt.fp.decode():
            return answer({"error": "another model or KV layout (fingerprints differ)"})
        if not hmac.compare_digest(str(ask.get("mac", "")), self.fmt.mac(room)):
            return answer({"error": "the transfer key differs ($JAXKV_KV_TRANSFER_KEY)"})
        r = self.rooms.get(room)
        if not r.ready.wait(self.transfer_timeout):
            self.rooms.take(room)
            return answer({"error": f"no prefill of room {room} within {self.transfer_timeout} s"})
        self.rooms.take(room)
        if r.error:
            return answer({"error": r.error})
        run = []
        for h in want:
            if h not in r.pages:
                break
            run.append((h, r.pages[h]))
        answer({"pages": len(run), "page_bytes": self.fmt.size})
        for h, raw in run:
            wfile.write(h + raw)
        m = self.metrics
        m.kv_transfer_pages.labels(m.model_name, "sent").inc(len(run))
        m.kv_transfer_bytes.labels(m.model_name, "sent").inc(len(run) * (HASH + self.fmt.size))

    def copy_pages(self, eng, ids: list[int], salt: str | None) -> dict:
        """(engine thread) The prompt's cached full pages, encoded, by hash."""
        from jaxkv.worker import page_io

        ps, parent, pages, hashes = eng.config.page_size, salted_root(salt), [], []
        for i in range((len(ids) - 1) // ps):
            h = hash_page(parent, ids[i * ps : (i + 1) * ps])
            page = eng.bm.page_of(h)
            if page is None:
                break
            pages.append(page)
            hashes.append(h)
            parent = h
        if not pages:
            return {}
        data = page_io.page_out(eng.runner, pages)
        return {
            h: encode_page([x[j] for x in data], self.fmt.layout, self.fmt.fp, self.fmt.key)
            for j, h in enumerate(hashes)
        }

    # ------------------------------------------------------------ requests

    def wants(self, body) -> bool:
        return isinstance(body, dict) and body.get("bootstrap_room") is not None

    async def handle(self, ctx, request, body: dict, chat: bool):
        from jaxkv.entrypoints.openai import generate, prepare

        room, host, port = (
            body.get(k) for k in ("bootstrap_room", "bootstrap_host", "bootstrap_port")
        )
        if not isinstance(room, int) or isinstance(room, bool):
            raise APIError("bootstrap_room: must be an integer", "bootstrap_room")
        body = {k: v for k, v in body.items() if k not in FIELDS}
        if chat:
            items, echo = await asyncio.to_thread(prepare.chat_items, ctx, body), False
        else:
            items, echo = await asyncio.to_thread(prepare.completion_items, ctx, body)
        if any(it.lora for it in items) or len(items) != 1:
            raise APIError("bootstrap_room: a split request runs one prompt of the base model")
        salt = body.get("cache_salt")
        if self.mode == "prefill":
            return await self._prefill(ctx, request, body, items, room, salt, chat, generate)
        if not isinstance(host, str) or not isinstance(port, int):
            raise APIError(
                "bootstrap_host, bootstrap_port: the prefill side's address", "bootstrap_host"
            )
        ps, parent, hashes = self.engine.config.page_size, salted_root(salt), []
        ids = items[0].ids
        for i in range((len(ids) - 1) // ps):
            parent = hash_page(parent, ids[i * ps : (i + 1) * ps])
            hashes.append(parent)
        try:
            got, secs = await asyncio.to_thread(
                fetch, host, port, room, hashes, self.fmt, self.transfer_timeout
            )
        except HandoffError as e:
            self.metrics.error("kv_transfer")
            raise APIError(
                f"kv transfer of room {room}: {e}", None, 503, "KVTransferError"
            ) from None
        m = self.metrics
        m.kv_transfer_seconds.observe(secs)
        m.kv_transfer_pages.labels(m.model_name, "received").inc(len(got))
        m.kv_transfer_bytes.labels(m.model_name, "received").inc(len(got) * (HASH + self.fmt.size))
        if got:
            await ctx.loop.call(lambda eng: eng.tier.receive(got))
        return await generate.run_items(ctx, request, body, items, chat=chat, echo=echo)

    async def _prefill(self, ctx, request, body, items, room, salt, chat, generate):
        it = items[0]
        it.params = dataclasses.replace(it.params, max_tokens=1, n=1)
        try:
            resp = await generate.run_items(
                ctx, request, {**body, "stream": False}, items, chat=chat, echo=False
            )
            pages = await ctx.loop.call(lambda eng: self.copy_pages(eng, it.ids, salt))
        except Exception as e:
            self.rooms.put(room, None, f"the prefill failed: {str(e)[:300]}")
            raise
        self.rooms.put(room, pages)
        if body.get("stream"):
            from fastapi.responses import Response

            return Response(b"data: [DONE]\n\n", media_type="text/event-stream")
        return resp
