"""The wire side of the prefill/decode handoff (`pd`): the engine's pages
as frames (`PageFormat`), the decode side's `fetch`, and JAX's transfer
server where it runs."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import time

import numpy as np

from jaxkv.core.kv.disk import decode_page, page_bytes

log = logging.getLogger("jaxkv.serve")

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


def fetch(
    host: str,
    port: int,
    room: int,
    hashes: list[bytes],
    fmt: PageFormat,
    timeout: float,
    jax_server=None,
):
    """The pages of `hashes` (a leading run) from the prefill side of `room`:
    ([(hash, arrays)], seconds on the wire, "jax" or "tcp"), pulled through JAX's transfer
    server when both sides run one (`jax_server`: this side's), else as
    frames on the socket. HandoffError naming what failed."""
    ask = {"room": room, "fingerprint": fmt.fp.decode(), "hashes": [h.hex() for h in hashes]}
    ask["mac"] = fmt.mac(room)
    ask["jax"] = jax_server is not None
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
        if "jax" in head:
            got = _pull(jax_server, head["jax"], hashes[:n], fmt)
            return got, time.perf_counter() - t0, "jax"
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
    return out, time.perf_counter() - t0, "tcp"


def _pull(server, where: dict, hashes: list[bytes], fmt: PageFormat) -> list:
    """The pages the prefill side offered on its JAX transfer server."""
    import jax

    if not hashes:
        return []
    dev = jax.devices()[0]
    specs = [
        jax.ShapeDtypeStruct(
            (len(hashes),) + tuple(shape), dt, sharding=jax.sharding.SingleDeviceSharding(dev)
        )
        for shape, dt in fmt.layout
    ]
    try:
        got = server.connect(str(where["address"])).pull(int(where["uuid"]), specs)
    except Exception as e:  # noqa: BLE001 - the transfer's error, named
        raise HandoffError(f"JAX transfer from {where.get('address')} failed ({e})") from None
    data = [np.asarray(x) for x in got]
    return [(h, [x[i] for x in data]) for i, h in enumerate(hashes)]


def start_jax_transfer(host: str):
    """This process's JAX transfer server on `host`, or None where JAX has none."""
    try:
        import jax
        from jax.experimental import transfer

        addr = f"{host}:0" if ":" not in host else f"[{host}]:0"
        return transfer.start_transfer_server(jax.devices()[0].client, addr, [addr])
    except Exception as e:  # noqa: BLE001 - not available here: the socket path
        log.info("jaxkv serve: no JAX transfer server (%s); pages go over the socket", e)
        return None
