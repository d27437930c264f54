"""LoRA adapters over HTTP, as vLLM serves them (engine option enable_lora).

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}
    POST /v1/unload_lora_adapter  {"lora_name": ...}

A request whose `model` names a known adapter runs with it
(`prepare.Context.adapter`); /v1/models lists each adapter with its
`parent` (the served model) and `root` (its folder). Loading reads and
checks the PEFT folder on the engine thread (`EngineLoop.call`), between
two steps, and gives the adapter the next id never used in this server;
a bad folder is a 400 naming the problem, a name already loaded a 400,
unloading an unknown name a 404. Requests running with an adapter being
unloaded finish with it. Without LoRA both endpoints answer 404.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import PlainTextResponse

from jaxkv.core.lora import LoRARequest
from jaxkv.entrypoints.openai.protocol import APIError


def model_cards(ctx) -> list[dict]:
    """The /v1/models entries of the adapters known now."""
    loras = ctx.engine.loras
    if loras is None:
        return []
    known = dict(loras.known)  # read off the engine thread: a copy, then its entries
    return [{"id": name, "object": "model", "created": ctx.created, "owned_by": "jaxkv",
             "root": known[name].request.lora_path, "parent": ctx.served[0],
             "max_model_len": ctx.engine.max_model_len}
            for name in sorted(known) if name not in ctx.served]


def _field(body, name: str) -> str:
    if not isinstance(body, dict):
        raise APIError("request body: must be a JSON object")
    v = body.get(name)
    if not isinstance(v, str) or not v:
        raise APIError(f"{name}: must be a non-empty string, got {v!r}", name)
    return v


def _lora_on(ctx) -> None:
    if ctx.engine.loras is None:
        raise APIError("LoRA is off on this server (start it with --enable-lora)", None, 404,
                       "NotFoundError")


def install(app, ctx, read_body) -> None:
    """Add the two endpoints to `app`; `read_body(request)` reads a JSON body."""
    used = [0]  # the highest adapter id this server gave or saw

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        _lora_on(ctx)
        body = await read_body(request)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        if name in ctx.served:
            raise APIError(f"lora_name: {name!r} is the served model's name; choose another",
                           "lora_name")

        def load(engine):  # on the engine thread
            loras = engine.loras
            if name in loras.known:
                raise APIError(f"lora_name: the LoRA adapter {name!r} has already been loaded "
                               f"(from {loras.known[name].request.lora_path!r}); unload it first",
                               "lora_name")
            lid = max([used[0], *(a.request.lora_int_id for a in loras.known.values())]) + 1
            try:
                loras.resolve(LoRARequest(name, lid, path))
            except ValueError as e:
                raise APIError(str(e), "lora_path") from None
            used[0] = lid

        await ctx.loop.call(load)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        _lora_on(ctx)
        name = _field(await read_body(request), "lora_name")

        def unload(engine):  # on the engine thread
            if not engine.loras.remove(name):
                raise APIError(f"lora_name: the LoRA adapter {name!r} is not loaded (loaded: "
                               f"{', '.join(engine.loras.names()) or 'none'})", "lora_name", 404,
                               "NotFoundError")

        await ctx.loop.call(unload)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
