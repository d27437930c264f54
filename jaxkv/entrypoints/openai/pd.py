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

Pages travel through JAX's own transfer server (`jax.experimental.transfer`)
where both sides run one, offered only once a decode side asked (an offer
cannot be withdrawn), else as frames on the bootstrap socket in the disk
tier's checksummed page format (`disk.encode_page`). The engine's
fingerprint (model, weights digest, KV layout) must match on both sides,
and the handshake and frames are keyed by $JAXKV_KV_TRANSFER_KEY when set
(the same on both sides; unset: a plain checksum, for trusted networks).

Wire protocol on the bootstrap port: the decode side sends one JSON line
{"room", "fingerprint", "hashes": [hex, ...], "mac", "jax"}; the prefill
side answers one JSON line, {"pages": n, "page_bytes": b} or {"error":
text}, then n frames of (16-byte page hash, encoded page), or, with "jax"
on both sides, {"pages", "page_bytes", "jax": {"address", "uuid"}} to pull.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import secrets
import socketserver
import threading
import time

import numpy as np

from jaxkv.core.kv.disk import encode_page
from jaxkv.core.scheduling.page_pool import prompt_page_hashes, salted_root
from jaxkv.entrypoints.openai.pd_transfer import (
    HASH,
    HandoffError,
    PageFormat,
    fetch,
    start_jax_transfer,
)
from jaxkv.entrypoints.openai.protocol import APIError

log = logging.getLogger("jaxkv.serve")

MODES = ("null", "prefill", "decode")
FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


@dataclasses.dataclass
class Room:
    ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    pages: tuple | None = None  # ([hash], [leaf array [n, ...]]): the prompt's full pages
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

    def put(self, room: int, pages: tuple | None, error: str | None = None) -> None:
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
        transfer_backend: str = "auto",
    ):
        if transfer_backend not in ("auto", "jax", "tcp"):
            raise ValueError(
                f"disaggregation_transfer_backend: auto, jax or tcp, got {transfer_backend!r}"
            )
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
        self.jax = start_jax_transfer(host) if transfer_backend != "tcp" else None
        if transfer_backend == "jax" and self.jax is None:
            raise ValueError(
                "disaggregation_transfer_backend jax: JAX's transfer server does not start here"
            )
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
        hashes, leaves = r.pages
        k = 0
        while k < min(len(want), len(hashes)) and want[k] == hashes[k]:
            k += 1
        head = {"pages": k, "page_bytes": self.fmt.size}
        transport = "jax" if ask.get("jax") and self.jax is not None and k else "tcp"
        if transport == "jax":
            import jax

            uuid = secrets.randbits(62)
            self.jax.await_pull(uuid, [jax.device_put(x[:k]) for x in leaves])
            answer({**head, "jax": {"address": self.jax.address(), "uuid": uuid}})
        else:
            answer(head)
            for i in range(k):
                page = [x[i] for x in leaves]
                wfile.write(
                    hashes[i] + encode_page(page, self.fmt.layout, self.fmt.fp, self.fmt.key)
                )
        m = self.metrics
        m.kv_transfer_pages.labels(m.model_name, "sent", transport).inc(k)
        m.kv_transfer_bytes.labels(m.model_name, "sent").inc(k * (HASH + self.fmt.size))

    def copy_pages(self, eng, ids: list[int], salt: str | None) -> tuple:
        """(engine thread) The prompt's cached full pages: ([hash], [leaf
        array [n, ...]])."""
        from jaxkv.worker import page_io

        pages, hashes = [], []
        for h in prompt_page_hashes(ids, eng.config.page_size, salted_root(salt)):
            page = eng.bm.page_of(h)
            if page is None:
                break
            pages.append(page)
            hashes.append(h)
        if not pages:
            return [], [np.zeros((0,) + shape, dt) for shape, dt in self.fmt.layout]
        return hashes, page_io.page_out(eng.runner, pages)

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
        hashes = prompt_page_hashes(items[0].ids, self.engine.config.page_size, salted_root(salt))
        try:
            got, secs, transport = await asyncio.to_thread(
                fetch, host, port, room, hashes, self.fmt, self.transfer_timeout, self.jax
            )
        except HandoffError as e:
            self.metrics.error("kv_transfer")
            raise APIError(
                f"kv transfer of room {room}: {e}", None, 503, "KVTransferError"
            ) from None
        m = self.metrics
        m.kv_transfer_seconds.observe(secs)
        m.kv_transfer_pages.labels(m.model_name, "received", transport).inc(len(got))
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
