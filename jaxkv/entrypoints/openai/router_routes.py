"""The endpoints routers call on a worker, in the shapes sglang-router (the
SGLang Model Gateway) and vllm-router read:

    GET  /get_server_info, /server_info: model, dp_size, tp_size,
         kv_block_size (the page size), max_model_len, instance id,
         version, disaggregation mode
    GET  /get_model_info, /model_info
    GET  /get_load: a list with one entry per data-parallel rank,
         {"dp_rank", "load": running + waiting requests, "num_reqs",
         "num_waiting_reqs", "num_tokens": KV slots held}; sglang-router
         reads the list and sums `num_tokens` (a bare object reads as
         "unknown load" there)
    POST /flush_cache: forget the cached pages no request holds, and the
         host tier's
    GET  /health_generate: 200 once one real token came out (503 else)
    POST /v1/completions/render, /v1/chat/completions/render: the token ids
         the worker would run, with every check a real request passes
    GET  /kv_event_sources: where the KV events are published
         (`kv_events`), a bare JSON list as vLLM answers it

Behind `--api-key` every one needs the key (`guard.Guard`), /health_generate
too: it spends a step.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from jaxkv.core.sampling_params import SamplingParams
from jaxkv.entrypoints.openai import prepare
from jaxkv.entrypoints.openai.protocol import APIError

HEALTH_GENERATE_TIMEOUT = 30.0


def version() -> str:
    try:
        return importlib.metadata.version("jaxkv")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def server_info(ctx, *, data_parallel_rank: int = 0, data_parallel_size: int = 1) -> dict:
    eng = ctx.engine
    cfg = eng.config
    return {
        "model_path": ctx.model_path or ctx.served[0],
        "tokenizer_path": ctx.model_path or ctx.served[0],
        "served_model_name": ctx.served[0],
        "dp_size": data_parallel_size,
        "data_parallel_rank": data_parallel_rank,
        "tp_size": cfg.tensor_parallel_size,
        "kv_block_size": cfg.page_size,
        "page_size": cfg.page_size,
        "max_model_len": eng.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "num_pages": eng.bm.num_pages,
        "max_total_num_tokens": (eng.bm.num_pages - 1) * cfg.page_size,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "disaggregation_mode": ctx.disaggregation_mode,
        "instance_id": ctx.instance_id,
        "version": version(),
        "engine": "jaxkv",
    }


def model_info(ctx) -> dict:
    mc = ctx.engine.model_config
    return {
        "model_path": ctx.model_path or ctx.served[0],
        "tokenizer_path": ctx.model_path or ctx.served[0],
        "served_model_name": ctx.served[0],
        "is_generation": True,
        "model_type": mc.architecture,
        "architectures": [mc.architecture],
        "vocab_size": mc.vocab_size,
        "max_model_len": ctx.engine.max_model_len,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "preferred_sampling_params": None,
    }


def load(loop, rank: int = 0) -> dict:
    running, waiting, tokens = loop.counts()
    return {
        "dp_rank": rank,
        "load": running + waiting,
        "num_reqs": running,
        "num_waiting_reqs": waiting,
        "num_tokens": tokens,
    }


async def health_generate(ctx) -> JSONResponse:
    """One real token through the engine, within HEALTH_GENERATE_TIMEOUT s."""
    eng = ctx.engine
    bos = eng.model_config.bos_token_id
    first = bos if bos is not None else 0
    q: asyncio.Queue = asyncio.Queue()
    try:
        stream = ctx.loop.submit(
            {"prompt_token_ids": [first]},
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            out=q,
        )
    except RuntimeError as e:  # QueueFull, ShuttingDown
        return JSONResponse({"status": "unhealthy", "error": str(e)}, status_code=503)
    try:
        while True:
            _, out = await asyncio.wait_for(q.get(), HEALTH_GENERATE_TIMEOUT)
            if out.finished:
                break
    except TimeoutError:
        ctx.loop.abort(stream.request_id)
        return JSONResponse(
            {
                "status": "unhealthy",
                "error": f"no token within {HEALTH_GENERATE_TIMEOUT:.0f} s",
            },
            status_code=503,
        )
    if out.error is not None or not out.outputs[0].token_ids:
        return JSONResponse({"status": "unhealthy", "error": out.error}, status_code=503)
    return JSONResponse({"status": "ok"})


def _render(items, model: str) -> dict:
    reqs = [
        {
            "prompt": it.text,
            "prompt_token_ids": it.ids,
            "num_prompt_tokens": len(it.ids),
            "max_tokens": it.params.max_tokens,
            "lora": it.lora,
        }
        for it in items
    ]
    return {
        "object": "render",
        "id": f"render-{uuid.uuid4().hex}",
        "model": model,
        "prompt_token_ids": reqs[0]["prompt_token_ids"] if len(reqs) == 1 else None,
        "requests": reqs,
    }


def install(app, ctx, body, *, data_parallel_rank: int = 0, kv_events=None) -> None:
    """Add the router endpoints to `app`; `body(request)` reads a checked
    JSON body; `kv_events`: the `kv_events.Publisher`, when events are on."""

    async def info():
        return server_info(ctx, data_parallel_rank=data_parallel_rank)

    async def minfo():
        return model_info(ctx)

    for path in ("/get_server_info", "/server_info"):
        app.get(path)(info)
    for path in ("/get_model_info", "/model_info"):
        app.get(path)(minfo)

    @app.get("/get_load")
    async def get_load():
        return [load(ctx.loop, data_parallel_rank)]

    @app.post("/flush_cache")
    async def flush_cache():
        got = await ctx.loop.call(lambda eng: eng.flush_cache())
        return {"status": "ok", "flushed": True, **got}

    @app.get("/health_generate")
    async def health_gen():
        if not ctx.loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return await health_generate(ctx)

    @app.post("/v1/completions/render")
    async def render_completions(request: Request):
        b = await body(request)
        items, _ = await asyncio.to_thread(prepare.completion_items, ctx, b)
        return _render(items, b.get("model") or ctx.served[0])

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request):
        b = await body(request)
        items = await asyncio.to_thread(prepare.chat_items, ctx, b)
        return _render(items, b.get("model") or ctx.served[0])

    @app.get("/kv_event_sources")
    async def kv_event_sources():
        return kv_events.sources() if kv_events is not None else []


def check_rank_header(request: Request, size: int = 1) -> int | None:
    """The `X-data-parallel-rank` header's rank (None when absent); a value
    that is not a rank below `size` is a 400 naming the header."""
    raw = request.headers.get("x-data-parallel-rank")
    if raw is None:
        return None
    try:
        rank = int(raw)
    except ValueError:
        rank = -1
    if not 0 <= rank < size:
        raise APIError(
            f"X-data-parallel-rank: {raw[:20]!r} is not a data-parallel rank of this server "
            f"(0..{size - 1})",
            "X-data-parallel-rank",
        )
    return rank
