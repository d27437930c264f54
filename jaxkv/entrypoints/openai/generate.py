"""The two generation endpoints: the body made into engine requests in a
worker thread (`prepare`), handed to the engine loop, then answered at once
(JSON) or as they run (server-sent events ending in `data: [DONE]`).

A choice carries `token_ids` (vLLM's field: all of them in a response, the
new ones in a chunk) when the body asks `return_token_ids: true`, and always
for a model without a tokenizer, whose answers have no text: its stream
then sends each step's tokens as they come."""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from jaxkv.entrypoints.openai import tool_stream
from jaxkv.entrypoints.openai import tools as tools_mod
from jaxkv.entrypoints.openai.engine_loop import QueueFull, ShuttingDown
from jaxkv.entrypoints.openai.prepare import Context, Item, chat_items, completion_items
from jaxkv.entrypoints.openai.protocol import APIError
from jaxkv.entrypoints.openai.reasoning import Reasoning
from jaxkv.entrypoints.openai.responses import json_bytes, now, sse, usage

log = logging.getLogger("jaxkv.serve")


async def completions(ctx: Context, request: Request, body) -> Response | dict:
    items, echo = await asyncio.to_thread(completion_items, ctx, body)
    return await run_items(ctx, request, body, items, chat=False, echo=echo)


async def chat(ctx: Context, request: Request, body) -> Response | dict:
    items = await asyncio.to_thread(chat_items, ctx, body)
    return await run_items(ctx, request, body, items, chat=True, echo=False)


def _with_ids(ctx: Context, body: dict) -> bool:
    """Whether choices carry `token_ids`: asked for, or there is no text."""
    return bool(body.get("return_token_ids")) or ctx.engine.tokenizer is None


def submit_items(ctx: Context, items: list[Item], body: dict, q: asyncio.Queue) -> list:
    """Hand `items` to the engine loop, outputs to `q` by index; all or none
    (429 when the queue is full, 503 while shutting down)."""
    streams = []
    try:
        for i, it in enumerate(items):
            streams.append(
                ctx.loop.submit(
                    {"prompt_token_ids": it.ids},
                    it.params,
                    out=q,
                    index=i,
                    cache_salt=body.get("cache_salt"),
                    lora_request=it.adapter or it.lora,
                )
            )
    except (QueueFull, ShuttingDown) as e:
        for s in streams:
            ctx.loop.abort(s.request_id)
        if isinstance(e, QueueFull):
            raise APIError(str(e), None, 429, "RateLimitError") from None
        raise APIError(str(e), None, 503, "ServiceUnavailableError") from None
    return streams


async def run_items(
    ctx: Context, request: Request, body: dict, items: list[Item], *, chat: bool, echo: bool
):
    """Run prepared `items` and answer as the body asks (JSON or a stream)."""
    q: asyncio.Queue = asyncio.Queue()
    streams = submit_items(ctx, items, body, q)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if body.get("stream"):
        return StreamingResponse(
            _stream(ctx, rid, body, items, streams, q, chat, echo),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    finals = await _collect(ctx, request, q, streams)
    if finals is None:  # the client went away; its requests are aborted
        return Response(status_code=499)
    # Formatting (logprobs of every token) and writing the JSON grow with
    # the answer: a worker thread's work, not the event loop's.
    return await asyncio.to_thread(_answer, ctx, rid, body, items, finals, chat, echo)


def _answer(
    ctx: Context, rid: str, body: dict, items: list[Item], finals, chat: bool, echo: bool
) -> Response:
    fmt, choices, with_ids = ctx.fmt.named(items[0].lora), [], _with_ids(ctx, body)
    for i, (it, out) in enumerate(zip(items, finals)):
        if any(c.finish_reason == "error" for c in out.outputs):
            raise APIError(
                out.error or "engine: the request failed", None, 500, "InternalServerError"
            )
        for c in out.outputs:
            lps = None
            if c.logprobs is not None:
                lps = (
                    fmt.chat_logprobs(c.logprobs)
                    if chat
                    else fmt.completion_logprobs(c.logprobs, len(it.text or "") if echo else 0)
                )
            idx = i * it.params.n + c.index
            if chat:
                choice = fmt.chat_choice(idx, c, logprobs=lps)
                text = c.text
                if ctx.reasoning_parser:
                    thinking, text = Reasoning(ctx.reasoning_parser, it.text or "").split(text)
                    choice["message"].update(content=text, reasoning_content=thinking)
                if it.tools is not None:
                    content, calls = tools_mod.parse(text, it.tools)
                    if calls:
                        choice["message"].update(content=content, tool_calls=calls)
                        if c.finish_reason == "stop":
                            choice["finish_reason"] = "tool_calls"
            else:
                text = ((it.text or "") if echo else "") + c.text
                choice = fmt.completion_choice(idx, c, text=text, logprobs=lps, final=True)
            if with_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
    u = usage(
        sum(len(it.ids) for it in items),
        sum(len(c.token_ids) for o in finals for c in o.outputs),
        sum(o.num_cached_tokens for o in finals),
    )
    resp = fmt.envelope(rid, "chat.completion" if chat else "text_completion", now(), choices, u)
    if any(it.params.prompt_logprobs is not None for it in items):
        resp["prompt_logprobs"] = (
            [fmt.prompt_logprobs(o.prompt_logprobs) for o in finals]
            if len(finals) > 1
            else fmt.prompt_logprobs(finals[0].prompt_logprobs)
        )
    return Response(json_bytes(resp), media_type="application/json")


async def _collect(ctx: Context, request: Request, q: asyncio.Queue, streams):
    """Every request's final output, in order; None if the client left."""
    finals: dict = {}
    try:
        while len(finals) < len(streams):
            try:
                i, out = await asyncio.wait_for(q.get(), 0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            if out.finished:
                finals[i] = out
        return [finals[i] for i in range(len(streams))]
    finally:
        for s in streams:
            if s.index not in finals:
                ctx.loop.abort(s.request_id)


def _error_event(out) -> dict:
    return {
        "error": {
            "message": out.error or "engine: the request failed",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }


async def _stream(
    ctx: Context, rid: str, body: dict, items: list[Item], streams, q, chat: bool, echo: bool
):
    fmt = ctx.fmt.named(items[0].lora)
    created = now()
    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    with_ids = _with_ids(ctx, body)
    pending = {s.index: s for s in streams}
    closed: set = set()  # (item, answer) whose final chunk is out
    offset = {
        (i, k): len(it.text or "") if echo else 0
        for i, it in enumerate(items)
        for k in range(it.params.n)
    }
    generated = [0] * len(items)
    cached = [0] * len(items)
    parsers = {
        (i, k): tool_stream.StreamParser(it.tools)
        for i, it in enumerate(items)
        if chat and it.tools is not None
        for k in range(it.params.n)
    }
    thinkers = {
        (i, k): Reasoning(ctx.reasoning_parser, it.text or "")
        for i, it in enumerate(items)
        if chat and ctx.reasoning_parser
        for k in range(it.params.n)
    }

    def chunk(choices):
        return sse(fmt.envelope(rid, obj, created, choices, with_usage=include_usage))

    try:
        for i, it in enumerate(items):
            for k in range(it.params.n):
                idx = i * it.params.n + k
                if chat:
                    yield chunk(
                        [
                            {
                                "index": idx,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                elif echo:
                    yield chunk(
                        [
                            {
                                "index": idx,
                                "text": it.text or "",
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
        while pending:
            i, out = await q.get()
            if out.finished:
                pending.pop(i, None)
                generated[i] = sum(len(c.token_ids) for c in out.outputs)
                cached[i] = out.num_cached_tokens
            if any(c.finish_reason == "error" for c in out.outputs):
                yield sse(_error_event(out))
                continue
            for c in out.outputs:
                key = (i, c.index)
                if key in closed:
                    continue
                lps = None
                if c.delta_logprobs:
                    new = c.delta_logprobs
                    lps = (
                        fmt.chat_logprobs(new)
                        if chat
                        else fmt.completion_logprobs(new, offset[key])
                    )
                done = c.finish_reason is not None
                if not (c.delta_text or lps or done or with_ids and c.delta_token_ids):
                    continue
                idx = i * items[i].params.n + c.index
                if chat:  # reasoning, content and tool calls apart where parsers are on
                    thinking, content = (
                        thinkers[key].feed(c.delta_text, done)
                        if key in thinkers
                        else ("", c.delta_text)
                    )
                    calls, finish = [], c.finish_reason
                    if key in parsers:
                        content, calls = parsers[key].feed(content, done)
                        if parsers[key].calls and finish == "stop":
                            finish = "tool_calls"
                    for d in calls:  # each call: its id and name, then its arguments
                        yield chunk(
                            [
                                {
                                    "index": idx,
                                    "delta": {"tool_calls": [d]},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    delta = {"reasoning_content": thinking} if thinking else {}
                    if content:
                        delta["content"] = content
                    if not (delta or lps or done or with_ids and c.delta_token_ids):
                        continue
                    choice = {
                        "index": idx,
                        "delta": delta,
                        "logprobs": lps,
                        "finish_reason": finish if done else None,
                        "stop_reason": c.stop_reason if done else None,
                    }
                else:
                    choice = fmt.completion_choice(
                        idx, c, text=c.delta_text, logprobs=lps, final=done
                    )
                if with_ids:
                    choice["token_ids"] = list(c.delta_token_ids)
                offset[key] += len(c.delta_text)
                if done:
                    closed.add(key)
                yield chunk([choice])
        if include_usage:
            yield sse(
                fmt.envelope(
                    rid,
                    obj,
                    created,
                    [],
                    usage(sum(len(it.ids) for it in items), sum(generated), sum(cached)),
                )
            )
        yield sse("[DONE]")
    except Exception as e:  # a fault here ends this stream, named, not the server
        log.exception("jaxkv serve: stream %s failed", rid)
        yield sse(
            {
                "error": {
                    "message": f"internal server error ({type(e).__name__}); the server logged it",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        )
        yield sse("[DONE]")
    finally:  # finished, or the client went away (the task is cancelled)
        for s in pending.values():
            ctx.loop.abort(s.request_id)
