"""`jaxkv serve`: the OpenAI API over HTTP (FastAPI + uvicorn, as vLLM).

    POST /v1/completions, /v1/chat/completions (stream: server-sent events)
    GET  /v1/models, /health, /metrics (Prometheus text)
    GET  / (the KV cache, live: a chat box and the page pool), /v1/kv_map
    POST /tokenize, /detokenize

One engine thread owns the LLMEngine (`engine_loop.EngineLoop`); handlers
check a request (naming the bad field in a 400), hand it over and read its
outputs back. A client that goes away aborts its requests. SIGTERM stops
accepting, lets the requests in flight finish (aborting them after the
shutdown timeout) and exits 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from jaxkv.entrypoints.openai import generate, kv_map
from jaxkv.entrypoints.openai.engine_loop import EngineLoop
from jaxkv.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from jaxkv.entrypoints.openai.protocol import APIError, chat_messages
from jaxkv.entrypoints.openai.responses import Formatter

log = logging.getLogger("jaxkv.serve")


async def _json(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"request body: not valid JSON ({e})", None) from None


def build_app(engine, served_model_names: list[str], *, max_queued_requests: int | None = None,
              ) -> FastAPI:
    """The app and its engine loop (`app.state.engine_loop`); the loop starts
    and stops with the app's lifespan."""
    metrics = ServerMetrics(served_model_names[0])
    loop = EngineLoop(engine, metrics, max_queued_requests=max_queued_requests)
    ctx = generate.Context(engine, loop, Formatter(engine.tokenizer, served_model_names[0]),
                           list(served_model_names))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="jaxkv", lifespan=lifespan)
    app.state.engine_loop = loop
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        metrics.error({429: "queue_full", 503: "shutting_down"}.get(e.status, "invalid_request"))
        return JSONResponse(e.body(), status_code=e.status)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate.completions(ctx, request, await _json(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate.chat(ctx, request, await _json(request))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": ctx.created, "owned_by": "jaxkv",
             "root": name, "max_model_len": engine.max_model_len}
            for name in served_model_names]}

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
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json(request)
        tok = _tokenizer(engine)
        if not isinstance(body, dict):
            raise APIError("request body: must be a JSON object")
        add_special = body.get("add_special_tokens", "messages" not in body)
        if not isinstance(add_special, bool):
            raise APIError("add_special_tokens: must be true or false", "add_special_tokens")
        if "messages" in body:
            text = generate.render_chat(ctx, chat_messages(body), body)
        else:
            text = body.get("prompt")
            if not isinstance(text, str):
                raise APIError("prompt: must be a string", "prompt")
        try:
            ids = tok.encode(text, add_special_tokens=add_special)
        except (TypeError, ValueError) as e:
            raise APIError(f"prompt: cannot be tokenized ({e})", "prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json(request)
        tok = _tokenizer(engine)
        ids = body.get("tokens") if isinstance(body, dict) else None
        vocab = engine.model_config.vocab_size
        if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise APIError(f"tokens: must be a list of token ids below {vocab}", "tokens")
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}

    return app


def _tokenizer(engine):
    if engine.tokenizer is None:
        raise APIError("this model has no tokenizer", None)
    return engine.tokenizer


def serve(engine, served_model_names: list[str], *, host: str = "127.0.0.1", port: int = 8000,
          max_queued_requests: int | None = None, shutdown_timeout: float = 30.0,
          log_level: str = "info") -> int:
    """Run the server until SIGTERM / SIGINT; returns the exit status (0)."""
    import uvicorn

    app = build_app(engine, served_model_names, max_queued_requests=max_queued_requests)
    loop: EngineLoop = app.state.engine_loop

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                log.warning("jaxkv serve: signal %d, finishing %d requests (at most %.0f s)",
                            sig, loop.num_in_flight(), shutdown_timeout)
                loop.begin_shutdown(shutdown_timeout)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(shutdown_timeout) + 5)
    # uvicorn re-raises the signal it stopped on once it is done; with this
    # handler in place that ends the process normally (exit 0).
    signal.signal(signal.SIGTERM, lambda *_: None)
    Server(config).run()
    return 0
