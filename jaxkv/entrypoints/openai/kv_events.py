"""KV events: what enters and leaves the prefix cache, published over ZMQ
in vLLM's shape so that a KV-aware router (vllm-router's `kv_aware`, or any
subscriber written for vLLM) knows exactly which replica holds which pages.

Configured as vLLM's `--kv-events-config` is: a JSON object with
`enable_kv_cache_events`, `publisher` ("zmq" or "null"), `endpoint` (a PUB
socket, default tcp://*:5557), `replay_endpoint` (a ROUTER socket serving
missed batches, optional), `buffer_steps` (batches kept for replay) and
`topic`.

Wire format, per message: three frames, [topic, sequence number (8 bytes,
big-endian), msgpack payload]. The payload is one batch:
[timestamp, [event, ...], data_parallel_rank]; each event is a tagged
array:

    ["BlockStored", [hash], parent_hash | None, token_ids, block_size, None, "GPU"]
    ["BlockRemoved", [hash], "GPU"]
    ["AllBlocksCleared"]

A hash is the page's chained blake2b name (`page_pool.hash_page`) folded to
an unsigned 64-bit int (its last 8 bytes, big-endian), as vLLM sends by
default. "GPU" names the accelerator's pool (vLLM's word), whatever the
platform. A replay request is one frame holding the first wanted sequence
number; the answer is a [sequence, payload] pair per buffered batch from
there, then [-1, b""].

The pool records events (`PagePool.events`); the engine thread hands each
step's to `Publisher.publish`, whose own thread encodes and sends them, so
the engine never waits on a socket.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
import time

log = logging.getLogger("jaxkv.serve")

DEFAULTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def parse_config(text: str | dict | None) -> dict | None:
    """The checked config from `--kv-events-config` (JSON text or a dict);
    None when events are off. Unknown keys and bad values are a ValueError
    naming them."""
    if text is None:
        return None
    try:
        cfg = json.loads(text) if isinstance(text, str) else dict(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"kv_events_config: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError("kv_events_config: must be a JSON object")
    unknown = sorted(set(cfg) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"kv_events_config: unknown keys {unknown}; known: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **cfg}
    if not cfg["enable_kv_cache_events"] or cfg["publisher"] == "null":
        return None
    if cfg["publisher"] != "zmq":
        raise ValueError(
            f"kv_events_config: publisher must be zmq or null, got {cfg['publisher']!r}"
        )
    for key in ("endpoint", "replay_endpoint"):
        v = cfg[key]
        if v is not None and (not isinstance(v, str) or "://" not in v):
            raise ValueError(f"kv_events_config: {key} must be a ZMQ address such as tcp://*:5557")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise ValueError(f"kv_events_config: {key} must be a positive integer")
    if not isinstance(cfg["topic"], str):
        raise ValueError("kv_events_config: topic must be a string")
    return cfg


def block_hash(h: bytes) -> int:
    """A page's name as the events carry it: its last 8 bytes as an unsigned int."""
    return int.from_bytes(h[-8:], "big")


def encode_events(events: list[tuple], page_size: int) -> list[list]:
    """The pool's records as vLLM's tagged event arrays."""
    out = []
    for ev in events:
        if ev[0] == "stored":
            _, h, parent, tokens = ev
            out.append(
                [
                    "BlockStored",
                    [block_hash(h)],
                    block_hash(parent) if parent else None,
                    [int(t) for t in tokens],
                    page_size,
                    None,
                    "GPU",
                ]
            )
        elif ev[0] == "removed":
            out.append(["BlockRemoved", [block_hash(ev[1])], "GPU"])
        else:
            out.append(["AllBlocksCleared"])
    return out


def local_address(endpoint: str, host: str = "127.0.0.1") -> str:
    """The address a subscriber on this machine connects to (a wildcard bind
    `tcp://*:5557` -> `tcp://HOST:5557`)."""
    scheme, rest = endpoint.split("://", 1)
    if scheme == "tcp" and rest.startswith(("*:", "0.0.0.0:")):
        return f"tcp://{host}:{rest.rsplit(':', 1)[1]}"
    return endpoint


class Publisher:
    """A PUB socket (and optionally a replay ROUTER socket) on its own thread."""

    def __init__(self, cfg: dict, page_size: int, data_parallel_rank: int = 0):
        import msgpack  # noqa: F401 - fail at start, not in the thread
        import zmq

        self.cfg = cfg
        self.page_size = page_size
        self.rank = data_parallel_rank
        self.sent = 0  # batches published
        self._queue: queue.Queue = queue.Queue(maxsize=cfg["max_queue_size"])
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg["hwm"])
        self._pub.bind(cfg["endpoint"])
        self._replay = None
        if cfg["replay_endpoint"]:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(cfg["replay_endpoint"])
        self._buffer: collections.deque = collections.deque(maxlen=cfg["buffer_steps"])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxkv-kv-events", daemon=True)
        self._thread.start()

    def sources(self, host: str = "127.0.0.1") -> list[dict]:
        """What `/kv_event_sources` answers for this publisher."""
        replay = self.cfg["replay_endpoint"]
        return [
            {
                "data_parallel_rank": self.rank,
                "endpoint": local_address(self.cfg["endpoint"], host),
                "replay_endpoint": local_address(replay, host) if replay else None,
                "topic": self.cfg["topic"],
            }
        ]

    def publish(self, events: list[tuple]) -> None:
        """Queue one batch (engine thread; never blocks: a full queue drops
        the batch with a warning, and the subscriber sees the gap in the
        sequence numbers and may replay)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            log.warning("jaxkv serve: KV event queue full, %d events dropped", len(events))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        import msgpack
        import zmq

        topic = self.cfg["topic"].encode()
        seq = 0
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ts, events = self._queue.get(timeout=0.05)
            except queue.Empty:
                ts = None
            if ts is not None:
                payload = msgpack.packb(
                    [ts, encode_events(events, self.page_size), self.rank], use_bin_type=True
                )
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart([topic, seq_bytes, payload])
                self._buffer.append((seq, seq_bytes, payload))
                seq += 1
                self.sent += 1
            if self._replay is not None and poller.poll(0):
                self._answer_replay()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        client, start = frames[0], frames[-1]
        if len(start) != 8:
            self._replay.send_multipart([client, b"", END_SEQ, b""])
            return
        first = int.from_bytes(start, "big")
        for s, seq_bytes, payload in list(self._buffer):
            if s >= first:
                self._replay.send_multipart([client, b"", seq_bytes, payload])
        self._replay.send_multipart([client, b"", END_SEQ, b""])
