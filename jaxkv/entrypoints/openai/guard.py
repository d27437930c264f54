"""What stands between a client and the handlers: the Host header, the API
key, the bound on a request body and the time it may take to arrive,
reading and parsing the body without holding up the event loop, and every
failure answered as OpenAI's error JSON.

`Guard` is plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which
buffers streams and hides disconnects): with `allowed_hosts` it answers 400
to a request whose Host header names another host (a web page whose
domain was rebound to 127.0.0.1 cannot reach a server on localhost); with
an API key it answers 401 to any path but /health and the page's HTML
unless the request carries `Authorization: Bearer <key>`; it answers 413 to
a Content-Length over the bound before a byte of the body is read. A body
sent without a length (chunked) is counted as it is read, and one that
takes longer than the body timeout gets 408 (`read_json`). Slow request
heads and the connection bound are `connections`'.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from jaxkv.entrypoints.openai.protocol import APIError

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
OPEN_PATHS = ("/health", "/")  # a load balancer's probe; static HTML whose fetches need the key


def too_large(limit: int) -> APIError:
    return APIError(
        f"request body: larger than this server's bound of {limit} bytes (--max-request-bytes)",
        None,
        413,
        "RequestTooLargeError",
    )


def unauthorized() -> APIError:
    return APIError(
        "Authorization: this server needs 'Authorization: Bearer <api key>' (--api-key)",
        None,
        401,
        "AuthenticationError",
    )


def check_api_key(api_key: str | None) -> str | None:
    """The key, or None for none; an empty one (an unset shell variable
    in `--api-key $KEY`) is a ValueError, never "no key"."""
    if api_key is not None and not api_key.strip():
        raise ValueError(
            "api_key: empty (an unset variable?); give a key, or leave the option "
            "out to serve without one"
        )
    return api_key


def default_allowed_hosts(bind: str) -> list[str] | None:
    """The Host names a server bound to `bind` answers by default: that
    address and localhost's names; None (any) for a wildcard bind."""
    if bind in ("0.0.0.0", "::", ""):
        return None
    return sorted({bind, "localhost", "127.0.0.1", "::1"})


def _host_name(value: bytes) -> str:
    """A Host header's host, without its port (IPv6 in brackets too)."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class Guard:
    """ASGI middleware: the Host header, the API key, and the body bound on
    Content-Length."""

    def __init__(
        self,
        app,
        *,
        api_key: str | None,
        max_request_bytes: int,
        metrics,
        allowed_hosts: list[str] | None = None,
    ):
        self.app = app
        self.key = check_api_key(api_key).encode() if api_key is not None else None
        self.limit = max_request_bytes
        self.metrics = metrics
        hosts = [h.lower().strip("[]") for h in allowed_hosts or ()]
        self.hosts = None if allowed_hosts is None or "*" in hosts else set(hosts)

    def _authorized(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # Both sides compared whole, in time independent of where they differ.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.hosts is not None and _host_name(headers.get(b"host", b"")) not in self.hosts:
            self.metrics.error("invalid_request")
            return await _send(
                send,
                APIError(
                    "Host: this server answers requests for "
                    f"{', '.join(sorted(self.hosts))} only (--allowed-hosts)",
                    None,
                    400,
                ),
            )
        if (
            self.key is not None
            and scope["path"] not in OPEN_PATHS
            and not self._authorized(headers)
        ):
            return await _send(send, unauthorized(), {"www-authenticate": "Bearer"})
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            self.metrics.error("invalid_request")
            return await _send(send, too_large(self.limit))
        return await self.app(scope, receive, send)


async def _send(send, e: APIError, headers: dict | None = None) -> None:
    body = json.dumps(e.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": e.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *((k.encode(), v.encode()) for k, v in (headers or {}).items()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def read_json(request: Request, limit: int, timeout: float | None = None):
    """The body parsed as JSON (`read_body`), a named 400 if it is not JSON.
    The parse runs in a worker thread."""
    return await asyncio.to_thread(parse_json, await read_body(request, limit, timeout))


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The body; 413 once more than `limit` bytes came, 408 when it has not
    all come within `timeout` seconds."""
    parts: list[bytes] = []

    async def receive():
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            parts.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout)
    except ClientDisconnect:
        raise APIError("request body: the client left before sending all of it", None) from None
    except TimeoutError:
        raise APIError(
            f"request body: did not arrive within {timeout:g} s", None, 408, "RequestTimeoutError"
        ) from None
    return b"".join(parts)


def parse_json(raw: bytes):
    try:
        return json.loads(raw)
    except RecursionError:
        raise APIError("request body: not valid JSON (nested too deeply)", None) from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an int of too many digits
        raise APIError(f"request body: not valid JSON ({e})", None) from None


def protect(app: FastAPI, metrics, api_key, max_request_bytes: int, allowed_hosts) -> None:
    """The `Guard` in front of `app` and its error answers
    (`install_error_handlers`); `metrics` counts the refusals."""
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        metrics=metrics,
        allowed_hosts=allowed_hosts,
    )
    install_error_handlers(app, metrics)


def install_error_handlers(app: FastAPI, metrics) -> None:
    """Every refusal and failure as {"error": {"message", "type", "param",
    "code"}}: APIError as raised, Starlette's own 404 / 405, and any other
    exception as a 500 that names only its type (the server logs the rest)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        if e.status < 500 or e.status == 503:  # a failed request: the engine loop counted it
            metrics.error(
                {429: "queue_full", 503: "shutting_down"}.get(e.status, "invalid_request")
            )
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        err = APIError(
            f"{request.method} {request.url.path}: {e.detail}",
            None,
            e.status_code,
            "NotFoundError" if e.status_code == 404 else "invalid_request_error",
        )
        return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        # Starlette raises `e` on once this answer is sent, so uvicorn logs it.
        metrics.error("server_error")
        err = APIError(
            f"internal server error ({type(e).__name__}); the server logged it",
            None,
            500,
            "InternalServerError",
        )
        return JSONResponse(err.body(), status_code=500)
