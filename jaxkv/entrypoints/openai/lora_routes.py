"""LoRA adapters over HTTP, as vLLM serves them (engine option enable_lora).

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}
    POST /v1/unload_lora_adapter  {"lora_name": ...}

A request whose `model` names a known adapter runs with it
(`prepare.Context.adapter`); /v1/models lists each adapter with its
`parent` (the served model) and `root` (its folder).

Loading at run time reads any folder the server can read, so it is off
unless the operator turns it on (`--enable-runtime-lora-loading` or
JAXKV_ALLOW_RUNTIME_LORA_UPDATING=1, vLLM's switch), and with `--lora-root`
it only reads folders under those roots (links resolved first). Off, both
endpoints answer 404 naming the switch. A folder is read and checked in a
worker thread (never on the event loop or the engine thread, so streams and
/health go on), and the adapter gets the next id never used in this
server; a bad folder is a 400 naming the problem, a name already loaded a
400, unloading an unknown name a 404. Requests running with an adapter
being unloaded finish with it. Without LoRA both endpoints answer 404.
"""

from __future__ import annotations

import asyncio
import itertools
import os

from fastapi import Request
from fastapi.responses import PlainTextResponse

from jaxkv.core.adapters.lora import LoRARequest
from jaxkv.entrypoints.openai.protocol import APIError
from jaxkv.reprs import short

RUNTIME_ENV = "JAXKV_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_loading_allowed(flag: bool) -> bool:
    """The switch: the option, or the environment variable set to 1/true."""
    return flag or os.environ.get(RUNTIME_ENV, "").lower() in ("1", "true", "yes", "on")


def model_cards(ctx) -> list[dict]:
    """The /v1/models entries of the adapters known now."""
    loras = ctx.engine.loras
    if loras is None:
        return []
    known = dict(loras.known)  # read off the engine thread: a copy, then its entries
    return [
        {
            "id": name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "jaxkv",
            "root": known[name].request.lora_path,
            "parent": ctx.served[0],
            "max_model_len": ctx.engine.max_model_len,
        }
        for name in sorted(known)
        if name not in ctx.served
    ]


def _field(body, name: str, limit: int = 4096) -> str:
    if not isinstance(body, dict):
        raise APIError("request body: must be a JSON object")
    v = body.get(name)
    if not isinstance(v, str) or not v or len(v) > limit or "\0" in v:
        raise APIError(f"{name}: must be a non-empty string of at most {limit} characters", name)
    return v


def _lora_on(ctx) -> None:
    if ctx.engine.loras is None:
        raise APIError(
            "LoRA is off on this server (start it with --enable-lora)", None, 404, "NotFoundError"
        )


def confined(path: str, roots: list[str]) -> str:
    """`path` resolved (links followed); an APIError unless it lies under
    one of `roots` (none given: anywhere)."""
    real = os.path.realpath(path)
    if roots and not any(os.path.commonpath([real, r]) == r for r in roots):
        raise APIError(
            "lora_path: outside the folders this server loads adapters from (--lora-root)",
            "lora_path",
            403,
            "PermissionDeniedError",
        )
    return real


def install(app, ctx, read_body, *, runtime: bool = False, roots: list[str] | None = None) -> None:
    """Add the two endpoints to `app`; `read_body(request)` reads a JSON
    body. `runtime`: loading and unloading allowed; `roots`: the folders
    adapters may come from."""
    roots = [os.path.realpath(r) for r in roots or []]
    loras = ctx.engine.loras
    first = 1 + max([0, *(a.request.lora_int_id for a in (loras.known.values() if loras else ()))])
    ids = itertools.count(first)  # ids never reused, also after an unload

    def allowed() -> None:
        _lora_on(ctx)
        if not runtime:
            raise APIError(
                "loading and unloading LoRA adapters at run time is off on this "
                "server (start it with --enable-runtime-lora-loading or "
                f"{RUNTIME_ENV}=1)",
                None,
                404,
                "NotFoundError",
            )

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        allowed()
        body = await read_body(request)
        name, path = _field(body, "lora_name", 256), _field(body, "lora_path")
        if name in ctx.served:
            raise APIError(
                f"lora_name: {short(name)} is the served model's name; choose another", "lora_name"
            )
        if name in ctx.engine.loras.known:
            raise APIError(
                f"lora_name: the LoRA adapter {short(name)} has already been loaded; "
                "unload it first",
                "lora_name",
            )
        confined(path, roots)

        def load():  # a worker thread: reads, checks, then registers under the adapters' lock
            try:
                ctx.engine.loras.resolve(LoRARequest(name, next(ids), path))
            except ValueError as e:
                msg = str(e)
                if "loaded already" in msg:
                    msg = (
                        f"lora_name: the LoRA adapter {short(name)} has already been loaded; "
                        "unload it first"
                    )
                raise APIError(
                    msg, "lora_name" if msg.startswith("lora_name") else "lora_path"
                ) from None

        await asyncio.to_thread(load)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        allowed()
        name = _field(await read_body(request), "lora_name", 256)
        if not ctx.engine.loras.remove(name):
            raise APIError(
                f"lora_name: the LoRA adapter {short(name)} is not loaded",
                "lora_name",
                404,
                "NotFoundError",
            )
        await asyncio.to_thread(release_memory)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def release_memory() -> None:
    """Hand freed heap back to the system (glibc keeps it otherwise, and a
    server that loads and unloads adapters would grow)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
