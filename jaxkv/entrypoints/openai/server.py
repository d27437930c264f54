"""`jaxkv serve`: the OpenAI API over HTTP (FastAPI + uvicorn, as vLLM).

    POST /v1/completions, /v1/chat/completions (stream: server-sent events)
    GET  /v1/models, /health, /metrics (Prometheus text)
    GET  / (the KV cache, live: a chat box and the page pool), /v1/kv_map,
         only with `enable_kv_map`
    POST /tokenize, /detokenize
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter (`lora_routes`; a
         request's `model` may name a LoRA adapter)
    the endpoints routers call (`router_routes`): server and model info,
         load, cache flush, a generating health check, render, KV event
         sources (events published with `kv_events_config`, `kv_events`)

One engine thread owns the LLMEngine (`engine_loop.EngineLoop`); handlers
read the body (at most `max_request_bytes`, else 413), make it into engine
requests in a worker thread (naming the bad field in a 400), hand them over
and read their outputs back. A client that goes away aborts its requests.
With `api_key` every endpoint but /health (and the page's static HTML)
needs `Authorization: Bearer <key>` (`guard.Guard`). SIGTERM stops
accepting requests: the server keeps listening and answers new ones 503
(and /health 503) while the requests in flight finish, aborts what is left
after the shutdown timeout, then closes and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from jaxkv.entrypoints.openai import (
    generate,
    kv_events,
    kv_map,
    lora_routes,
    pd,
    prepare,
    responses_api,
    router_routes,
)
from jaxkv.entrypoints.openai.connections import (  # noqa: F401 - DrainingServer: the API
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DrainingServer,
    run_draining,
)
from jaxkv.entrypoints.openai.engine_loop import EngineLoop
from jaxkv.entrypoints.openai.guard import (
    DEFAULT_MAX_REQUEST_BYTES,
    check_api_key,
    default_allowed_hosts,
    protect,
    read_json,
)
from jaxkv.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from jaxkv.entrypoints.openai.protocol import APIError
from jaxkv.entrypoints.openai.reasoning import PARSERS as REASONING
from jaxkv.entrypoints.openai.responses import Formatter
from jaxkv.entrypoints.openai.responses_store import Store, check_id
from jaxkv.entrypoints.openai.tools import PARSERS
from jaxkv.reprs import short

log = logging.getLogger("jaxkv.serve")


def build_app(
    engine,
    served_model_names: list[str],
    *,
    max_queued_requests: int | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    api_key: str | None = None,
    enable_kv_map: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    allowed_hosts: list[str] | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
    enable_runtime_lora_loading: bool = False,
    lora_roots: list[str] | None = None,
    kv_events_config: str | dict | None = None,
    model_path: str | None = None,
    data_parallel_rank: int = 0,
    disaggregation_mode: str = "null",
    disaggregation_bootstrap_host: str = "127.0.0.1",
    disaggregation_bootstrap_port: int = 8998,
    disaggregation_transfer_timeout: float = 30.0,
    disaggregation_room_timeout: float = 60.0,
    disaggregation_transfer_backend: str = "auto",
) -> FastAPI:
    """The app and its engine loop (`app.state.engine_loop`); the loop starts
    and stops with the app's lifespan. `max_request_bytes`: the largest body
    accepted (413 beyond); `body_timeout`: the seconds it may take to arrive
    (408 beyond). `api_key`: when set, what every endpoint but /health needs
    as `Authorization: Bearer <key>` (401 without); empty is refused.
    `allowed_hosts`: the Host header's names answered (None: any).
    `enable_kv_map`: serve the page map (`/`, `/v1/kv_map`), which shows
    every running request's length and progress to whoever may read it.
    `enable_runtime_lora_loading` (or $JAXKV_ALLOW_RUNTIME_LORA_UPDATING=1):
    the LoRA load / unload endpoints, reading only under `lora_roots` when
    given (`lora_routes`). `kv_events_config`: vLLM's KV-events config
    (`kv_events.parse_config`); `model_path`: what the model was loaded
    from, and `data_parallel_rank`: this engine's rank, for the router
    endpoints and the events. `disaggregation_*`: this server's side of a
    prefill/decode split (`pd`)."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes: must be at least 1, got {max_request_bytes}")
    if not body_timeout > 0:
        raise ValueError(f"body_timeout: must be positive, got {body_timeout}")
    api_key = check_api_key(api_key)
    for r in lora_roots or ():
        if not os.path.isdir(r):
            raise ValueError(f"lora_root: {r} is not a folder")
    clash = sorted(set(served_model_names) & set(engine.loras.names() if engine.loras else ()))
    if clash:
        raise ValueError(
            f"lora_modules: {clash} are served model names too; name the adapters apart"
        )
    events_cfg = kv_events.parse_config(kv_events_config)
    metrics = ServerMetrics(served_model_names[0])
    handoff = None
    if disaggregation_mode not in pd.MODES:
        raise ValueError(
            f"disaggregation_mode: one of {', '.join(pd.MODES)}, got {short(disaggregation_mode)}"
        )
    if disaggregation_mode != "null":
        handoff = pd.Handoff(
            engine,
            disaggregation_mode,
            metrics,
            host=disaggregation_bootstrap_host,
            bootstrap_port=disaggregation_bootstrap_port,
            transfer_timeout=disaggregation_transfer_timeout,
            room_timeout=disaggregation_room_timeout,
            transfer_backend=disaggregation_transfer_backend,
        )
    loop = EngineLoop(engine, metrics, max_queued_requests=max_queued_requests)
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(
            f"tool_call_parser: {short(tool_call_parser)} is not one of {', '.join(PARSERS)}"
        )
    if reasoning_parser is not None and reasoning_parser not in REASONING:
        raise ValueError(
            f"reasoning_parser: {short(reasoning_parser)} is not one of {', '.join(REASONING)}"
        )
    ctx = prepare.Context(
        engine,
        loop,
        Formatter(engine.tokenizer, served_model_names[0]),
        list(served_model_names),
        tool_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
        model_path=model_path,
        disaggregation_mode=disaggregation_mode,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if events_cfg is not None:
            loop.publisher = kv_events.Publisher(
                events_cfg, engine.config.page_size, data_parallel_rank
            )
        loop.start()
        if handoff is not None:
            handoff.start()
        try:
            yield
        finally:
            if handoff is not None:
                handoff.stop()
            loop.stop()
            if loop.publisher is not None:
                loop.publisher.close()

    app = FastAPI(title="jaxkv", lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.handoff = handoff
    app.state.metrics = metrics
    protect(app, metrics, api_key, max_request_bytes, allowed_hosts)

    async def body(request: Request):
        router_routes.check_rank_header(request)
        return await read_json(request, max_request_bytes, body_timeout)

    @app.post("/v1/completions")
    async def completions(request: Request):
        b = await body(request)
        if handoff is not None and handoff.wants(b):
            return await handoff.handle(ctx, request, b, chat=False)
        return await generate.completions(ctx, request, b)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        b = await body(request)
        if handoff is not None and handoff.wants(b):
            return await handoff.handle(ctx, request, b, chat=True)
        return await generate.chat(ctx, request, b)

    store = app.state.responses = Store()

    @app.post("/v1/responses")
    async def responses_create(request: Request):
        return await responses_api.create(ctx, store, request, await body(request))

    @app.get("/v1/responses/{rid}")
    async def responses_get(rid: str):
        got = store.get(check_id(rid, "response_id"))
        if got is None:
            raise APIError(
                f"response_id: no stored response {short(rid)}", "response_id", 404, "NotFoundError"
            )
        return Response(got[0], media_type="application/json")

    @app.delete("/v1/responses/{rid}")
    async def responses_delete(rid: str):
        if not store.delete(check_id(rid, "response_id")):
            raise APIError(
                f"response_id: no stored response {short(rid)}", "response_id", 404, "NotFoundError"
            )
        return {"id": rid, "object": "response", "deleted": True}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": ctx.created,
                    "owned_by": "jaxkv",
                    "root": name,
                    "parent": None,
                    "max_model_len": engine.max_model_len,
                }
                for name in served_model_names
            ]
            + lora_routes.model_cards(ctx),
        }

    lora_routes.install(
        app,
        ctx,
        body,
        roots=lora_roots,
        runtime=lora_routes.runtime_loading_allowed(enable_runtime_lora_loading),
    )

    router_routes.install(
        app,
        ctx,
        body,
        data_parallel_rank=data_parallel_rank,
        kv_events=_Sources(loop),
    )

    if enable_kv_map:

        @app.get("/", response_class=HTMLResponse)
        async def kv_page():
            return kv_map.PAGE

        @app.get("/v1/kv_map")
        async def kv_map_json():
            return await loop.call(kv_map.snapshot)

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if not loop.accepting:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await asyncio.to_thread(prepare.tokenize, ctx, await body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await asyncio.to_thread(prepare.detokenize, ctx, await body(request))

    return app


class _Sources:
    """The engine loop's publisher as `/kv_event_sources` reads it (made at
    start, so looked up per call)."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def sources(self) -> list[dict]:
        pub = self.loop.publisher
        return pub.sources() if pub is not None else []


def resolve_api_key(api_key: str | None) -> str | None:
    """The key given (an empty one is a ValueError), else $JAXKV_API_KEY
    (unset or empty: none), else None (no key asked)."""
    if api_key is not None:
        return check_api_key(api_key)
    return os.environ.get("JAXKV_API_KEY") or None


def serve(
    engine,
    served_model_names: list[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    api_key: str | None = None,
    allowed_hosts: list[str] | None = None,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    max_connections: int | None = None,
    **app_options,
) -> int:
    """Run the server until SIGTERM / SIGINT; returns the exit status (0).
    `api_key` None reads $JAXKV_API_KEY; `allowed_hosts` None: the bind
    address and localhost (any host for a wildcard bind); `header_timeout`
    and `max_connections`: `connections`; the rest: `build_app`'s."""
    hosts = allowed_hosts if allowed_hosts else default_allowed_hosts(host)
    app = build_app(
        engine,
        served_model_names,
        api_key=resolve_api_key(api_key),
        allowed_hosts=hosts,
        **app_options,
    )
    run_draining(
        app,
        app.state.engine_loop,
        host=host,
        port=port,
        header_timeout=header_timeout,
        max_connections=max_connections,
        log_level=log_level,
        shutdown_timeout=shutdown_timeout,
    )
    return 0
