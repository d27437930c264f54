"""The HTTP app of the data-parallel front (`dp_front.Front` routes; see
there) and `serve_dp`, which starts the replicas and serves it."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxkv.entrypoints.openai.dp_front import BROADCAST, GENERATE, Front, FrontErrors, _error
from jaxkv.entrypoints.openai.dp_replicas import NoReplica, Replicas
from jaxkv.entrypoints.openai.guard import DEFAULT_MAX_REQUEST_BYTES, protect, read_body
from jaxkv.entrypoints.openai.metrics import merge_metrics


def build_front(
    replicas: Replicas,
    served: list[str],
    *,
    api_key: str | None = None,
    allowed_hosts: list[str] | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    body_timeout: float = 60.0,
) -> FastAPI:
    front = Front(replicas, served)
    errors = FrontErrors()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(replicas.watch())
        try:
            yield
        finally:
            task.cancel()
            await replicas.client.aclose()

    app = FastAPI(title="jaxkv (data parallel)", lifespan=lifespan)
    app.state.front = front
    protect(app, errors, api_key, max_request_bytes, allowed_hosts)

    @app.get("/health")
    async def health():
        if not front.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not replicas.healthy():
            return JSONResponse({"status": "no replica up"}, status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        texts = []
        for rep, got in await front.everyone("GET", "/metrics"):
            if isinstance(got, httpx.Response) and got.status_code == 200:
                texts.append((str(rep.rank), got.text))
        own = "# HELP jaxkv:front_request_errors Requests the front refused, by reason.\n"
        own += "# TYPE jaxkv:front_request_errors counter\n" + "".join(
            f'jaxkv:front_request_errors_total{{reason="{k}"}} {v}\n'
            for k, v in errors.counts.items()
        )
        return Response(merge_metrics(texts) + own, media_type="text/plain; version=0.0.4")

    async def server_info():
        got = await front.call_any("GET", "/get_server_info")
        info = got.json()
        info.update(
            dp_size=replicas.n,
            data_parallel_rank=None,
            replicas=[x.describe() for x in replicas.replicas],
        )
        return info

    for path in ("/get_server_info", "/server_info"):
        app.get(path)(server_info)

    @app.get("/get_load")
    async def get_load():
        out = []
        for _rep, got in await front.everyone("GET", "/get_load"):
            if isinstance(got, httpx.Response) and got.status_code == 200:
                out += got.json()
        return sorted(out, key=lambda x: x["dp_rank"])

    @app.get("/health_generate")
    async def health_generate():
        got = await front.everyone("GET", "/health_generate")
        bad = [
            rep.rank for rep, g in got if not isinstance(g, httpx.Response) or g.status_code != 200
        ]
        if bad or len(got) < replicas.n:
            return _error(f"data-parallel replicas not generating: {bad or 'restarting'}", 503)
        return {"status": "ok"}

    @app.get("/kv_event_sources")
    async def kv_event_sources():
        if not replicas.user_events:
            return []
        out = []
        for _rep, got in await front.everyone("GET", "/kv_event_sources"):
            if isinstance(got, httpx.Response) and got.status_code == 200:
                out += got.json()
        return out

    @app.api_route("/v1/responses/{rid}", methods=["GET", "DELETE"])
    async def stored_response(rid: str, request: Request):
        last = None
        for _rep, got in await front.everyone(request.method, f"/v1/responses/{rid}"):
            if isinstance(got, httpx.Response):
                last = got
                if got.status_code != 404:
                    break
        if last is None:
            return _error("no data-parallel replica is up; retry", 503)
        return Response(last.content, status_code=last.status_code, media_type="application/json")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def anything(path: str, request: Request):
        path = "/" + path
        body = await read_body(request, max_request_bytes, body_timeout)
        try:
            if request.method == "POST" and path in GENERATE:
                if not front.accepting:
                    return _error("the server is shutting down and accepts no new requests", 503)
                return await front.route(request, path, body)
            if request.method == "POST" and path in BROADCAST:
                return await front.broadcast(path, body)
            return await front.forward(replicas.least_loaded(), request, body, path)
        except NoReplica as e:
            return _error(str(e), 503)

    return app


def serve_dp(
    replicas: Replicas,
    served: list[str],
    *,
    host: str,
    port: int,
    shutdown_timeout: float,
    api_key: str | None,
    allowed_hosts: list[str] | None,
    header_timeout: float,
    max_connections: int | None,
    max_request_bytes: int,
    body_timeout: float = 60.0,
    log_level: str = "warning",
) -> int:
    """Start the replicas, serve the front until SIGTERM / SIGINT (draining
    as one server does), then stop the replicas (each drains its own)."""
    from jaxkv.entrypoints.openai.connections import run_draining
    from jaxkv.entrypoints.openai.guard import default_allowed_hosts
    from jaxkv.entrypoints.openai.server import resolve_api_key

    replicas.start()
    try:
        app = build_front(
            replicas,
            served,
            api_key=resolve_api_key(api_key),
            allowed_hosts=allowed_hosts or default_allowed_hosts(host),
            max_request_bytes=max_request_bytes,
            body_timeout=body_timeout,
        )
        run_draining(
            app,
            app.state.front,
            host=host,
            port=port,
            header_timeout=header_timeout,
            max_connections=max_connections,
            log_level=log_level,
            shutdown_timeout=shutdown_timeout,
        )
    finally:
        replicas.close(shutdown_timeout + 10)
    return 0
