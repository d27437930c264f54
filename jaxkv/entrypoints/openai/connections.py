"""What a slow or silent client may hold of the server: uvicorn's HTTP
protocol with deadlines and a connection bound (uvicorn itself never times
out a request that has not finished arriving).

- Headers: a connection that has not sent a whole request head within
  `header_timeout` seconds of opening (or of its last response, when kept
  alive) is closed; if it sent part of one it first gets 408, as nginx
  answers. A request being served is never cut.
- Body: `guard.read_json` gives a body `body_timeout` seconds to arrive
  (408 otherwise).
- Connections: past `max_connections` open at once, a new one is answered
  503 and closed at once, so the server keeps file descriptors for /health
  and the streams in flight instead of failing to accept. `serve` raises
  the process's open-file limit to its hard limit first and keeps the
  bound below it.
"""

from __future__ import annotations

import json
import logging
import signal
import time

import uvicorn

log = logging.getLogger("jaxkv.serve")

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_BODY_TIMEOUT = 60.0
FD_RESERVE = 256  # descriptors kept for files, the engine and the connections' own pipes


def _raw(status: int, reason: str, message: str) -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": status,
            }
        }
    ).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


TIMEOUT_408 = _raw(408, "Request Timeout", "request: the request head did not arrive in time")
BUSY_503 = _raw(503, "Service Unavailable", "server: too many open connections; retry later")


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one; the soft limit now."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):
        return 1024


def default_max_connections(fd_limit: int) -> int:
    return max(64, min(fd_limit - FD_RESERVE, 16384))


def protocol_class(header_timeout: float, max_connections: int):
    """uvicorn's HTTP protocol class (h11, or httptools where installed)
    with the deadlines and bound above."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Guarded(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._timer = None
            self._received = 0
            if len(self.connections) > max_connections:
                transport.write(BUSY_503)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            """Start the head's deadline: the request head must arrive
            within `header_timeout` from now."""
            if self._timer is not None:
                self._timer.cancel()
            self._received = 0
            self._timer = self.loop.call_later(header_timeout, self._expire, self.cycle)

        def data_received(self, data: bytes) -> None:
            self._received += len(data)
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def _expire(self, armed) -> None:
            self._timer = None
            if self.transport.is_closing() or self.cycle is not armed:
                return  # closed, or a request's head arrived since
            if armed is not None and not armed.response_complete:
                return  # a pipelined request is being served; its end arms again
            if self._received:
                self.transport.write(TIMEOUT_408)
            self.transport.close()

        def connection_lost(self, exc) -> None:
            if getattr(self, "_timer", None) is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)

    return Guarded


def uvicorn_config(
    app,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    max_connections: int | None = None,
    **kw,
):
    """uvicorn.Config serving `app` with the guarded protocol."""
    import uvicorn

    if header_timeout <= 0:
        raise ValueError(f"header_timeout: must be positive, got {header_timeout}")
    limit = raise_fd_limit()
    if max_connections is None:
        max_connections = default_max_connections(limit)
    if max_connections < 1:
        raise ValueError(f"max_connections: must be at least 1, got {max_connections}")
    return uvicorn.Config(
        app, host=host, port=port, http=protocol_class(header_timeout, max_connections), **kw
    )


class DrainingServer(uvicorn.Server):
    """uvicorn that, on the first SIGTERM / SIGINT, goes on listening (new
    requests get 503, /health 503, so a load balancer moves on) until the
    engine loop holds no request or the shutdown timeout (plus 5 s) passed,
    and only then stops as uvicorn does: closes the listener and waits for
    the open responses to be written. Plain uvicorn closes the listener at
    once, so a request sent during the drain would find the port refused.
    A second signal stops at once (uvicorn's own handling)."""

    def __init__(self, config, engine_loop, shutdown_timeout: float):
        super().__init__(config)
        self.engine_loop = engine_loop
        self.shutdown_timeout = shutdown_timeout
        self.drain_until: float | None = None

    def handle_exit(self, sig, frame):
        if self.drain_until is not None or self.should_exit:
            return super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).append(sig)  # uvicorn re-raises it at the end
        log.warning(
            "jaxkv serve: signal %d, finishing %d requests (at most %.0f s)",
            sig,
            self.engine_loop.num_in_flight(),
            self.shutdown_timeout,
        )
        self.engine_loop.begin_shutdown(self.shutdown_timeout)
        self.drain_until = time.monotonic() + self.shutdown_timeout + 5

    async def on_tick(self, counter: int) -> bool:
        if (
            self.drain_until is not None
            and not self.should_exit
            and (self.engine_loop.num_in_flight() == 0 or time.monotonic() > self.drain_until)
        ):
            self.should_exit = True
        return await super().on_tick(counter)


def run_draining(
    app,
    in_flight,
    *,
    host,
    port,
    header_timeout,
    max_connections,
    log_level,
    shutdown_timeout: float,
) -> None:
    """Serve `app` with uvicorn until SIGTERM / SIGINT, draining
    `in_flight` (`DrainingServer`'s engine loop) first."""
    config = uvicorn_config(
        app,
        host=host,
        port=port,
        header_timeout=header_timeout,
        max_connections=max_connections,
        log_level=log_level,
        timeout_graceful_shutdown=int(shutdown_timeout) + 5,
    )
    # uvicorn re-raises the signal it stopped on once it is done; with this
    # handler in place that ends the process normally (exit 0).
    signal.signal(signal.SIGTERM, lambda *_: None)
    DrainingServer(config, in_flight, shutdown_timeout).run()
