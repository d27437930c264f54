"""The Responses API's stored responses, bounded in count and in bytes,
and the request fields that are stored or echoed, bounded before anything
is kept (OpenAI's own limits where it has them).

A stored response is kept as its JSON text, written once in a worker
thread, so GET answers it without converting a dict on the event loop;
the conversation (for `previous_response_id`) is kept beside it. The
newest `MAX_STORED` responses are kept, fewer when together they pass
`MAX_STORED_BYTES`."""

from __future__ import annotations

import collections
import json
import threading

from jaxkv.entrypoints.openai.protocol import APIError
from jaxkv.entrypoints.openai.responses import json_bytes
from jaxkv.reprs import short

MAX_STORED = 1024
MAX_STORED_BYTES = 256 << 20
MAX_ID_CHARS = 128
MAX_METADATA = 16  # pairs; keys of at most 64 characters, values of at most 512 (OpenAI's)
TEXT_KEYS = {"format", "verbosity"}
FORMAT_KEYS = {"type", "name", "schema", "strict", "description"}


class Store:
    """Stored responses by id (thread-safe)."""

    def __init__(self, size: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES):
        self.size = size
        self.max_bytes = max_bytes
        self._d: collections.OrderedDict[str, tuple[bytes, list, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, rid: str, response: dict, messages: list[dict]) -> None:
        """Keep `response` (as JSON) and its conversation; slow for a large
        one, so a server calls it in a worker thread."""
        raw = json_bytes(response)
        cost = len(raw) + len(json.dumps(messages))
        with self._lock:
            self._d[rid] = (raw, messages, cost)
            self._bytes += cost
            while self._d and (len(self._d) > self.size or self._bytes > self.max_bytes):
                _, (_, _, c) = self._d.popitem(last=False)
                self._bytes -= c

    def get(self, rid: str) -> tuple[bytes, list] | None:
        """(the response's JSON, its conversation), or None."""
        with self._lock:
            got = self._d.get(rid)
        return None if got is None else got[:2]

    def delete(self, rid: str) -> bool:
        with self._lock:
            got = self._d.pop(rid, None)
            if got is not None:
                self._bytes -= got[2]
        return got is not None

    @property
    def nbytes(self) -> int:
        return self._bytes


def check_id(v, field: str) -> str:
    """A response id: a short string, else a short 400 (404 for an id of
    the right form that is not stored is the caller's)."""
    if not isinstance(v, str) or not v or len(v) > MAX_ID_CHARS:
        raise APIError(
            f"{field}: must be a response id (a string of at most {MAX_ID_CHARS} "
            f"characters), got {short(v, 60)}",
            field,
        )
    return v


def check_fields(body: dict) -> None:
    """The fields a response stores or echoes: `metadata` (at most 16
    string pairs, OpenAI's bound), `text` and its `format` (known keys
    only), `previous_response_id` (an id)."""
    md = body.get("metadata")
    if md is not None:
        if not isinstance(md, dict):
            raise APIError(
                "metadata: must be an object of string keys and string values", "metadata"
            )
        if len(md) > MAX_METADATA:
            raise APIError(f"metadata: {len(md)} pairs; at most {MAX_METADATA}", "metadata")
        for k, v in md.items():
            if len(k) > 64:
                raise APIError(
                    f"metadata: key {short(k, 40)} is longer than 64 characters", "metadata"
                )
            if not isinstance(v, str) or len(v) > 512:
                raise APIError(
                    f"metadata[{short(k, 40)}]: must be a string of at most 512 characters",
                    "metadata",
                )
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise APIError("text: must be an object", "text")
        _known(text, TEXT_KEYS, "text")
        fmt = text.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict):
                raise APIError("text.format: must be an object", "text.format")
            _known(fmt, FORMAT_KEYS, "text.format")
            if fmt.get("name") is not None and (
                not isinstance(fmt["name"], str) or len(fmt["name"]) > 64
            ):
                raise APIError(
                    "text.format.name: must be a string of at most 64 characters",
                    "text.format.name",
                )
    if body.get("previous_response_id") is not None:
        check_id(body["previous_response_id"], "previous_response_id")


def _known(d: dict, keys: set, where: str) -> None:
    extra = set(d) - keys
    if extra:
        names = sorted(map(str, extra))
        raise APIError(
            f"{where}: unknown field{'s' if len(names) > 1 else ''} "
            f"{short(names[:5], 200)}{' and more' if len(names) > 5 else ''} "
            f"(known: {', '.join(sorted(keys))})",
            where,
        )
