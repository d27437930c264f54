"""The two generation endpoints: check the body, tokenize, hand the
requests to the engine loop, then answer at once (JSON) or as they run
(server-sent events ending in `data: [DONE]`)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from jaxkv.core.requests import parse_prompt
from jaxkv.core.sampling_params import SamplingParams, is_unicode
from jaxkv.entrypoints.openai.engine_loop import QueueFull, ShuttingDown
from jaxkv.entrypoints.openai.protocol import (APIError, chat_messages, check_common,
                                               completion_prompts, from_value_error,
                                               sampling_params)
from jaxkv.entrypoints.openai.responses import now, sse, usage

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass
class Context:
    engine: object
    loop: object  # EngineLoop
    fmt: object  # Formatter
    served: list[str]
    created: int = dataclasses.field(default_factory=now)


@dataclasses.dataclass
class Item:
    """One engine request of an HTTP call."""

    text: str | None  # the prompt text (echo)
    ids: list[int]
    params: SamplingParams


def _prepare(ctx: Context, prompt, params: SamplingParams, salt, rename) -> Item:
    eng = ctx.engine
    try:
        text, ids = parse_prompt(prompt, eng.tokenizer, eng.model_config.vocab_size)
        if params.max_tokens is None:  # the rest of the context
            params = dataclasses.replace(params, max_tokens=max(1, eng.max_model_len - len(ids)))
        eng.check_request({"prompt_token_ids": ids}, params, salt)
    except ValueError as e:
        raise from_value_error(e, rename) from None
    except TypeError as e:
        raise APIError(f"request: {e}") from None
    if text is None and eng.tokenizer is not None:
        text = eng.tokenizer.decode(ids, skip_special_tokens=False)
    return Item(text, ids, params)


def render_chat(ctx: Context, messages: list[dict], body: dict) -> str:
    tok = ctx.engine.tokenizer
    if tok is None or not tok.chat_template:
        raise APIError("messages: this model has no chat template; use /v1/completions",
                       "messages")
    for i, m in enumerate(messages):
        if not is_unicode(m["content"]) or not is_unicode(m["role"]):
            raise APIError(f"messages[{i}]: not valid Unicode text (a lone surrogate)",
                           f"messages[{i}].content")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError("chat_template_kwargs: must be an object", "chat_template_kwargs")
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=body.get(
            "add_generation_prompt", True), **kwargs)
    except (ValueError, TypeError) as e:
        raise APIError(f"messages: the chat template refused them ({e})", "messages") from None


async def completions(ctx: Context, request: Request, body) -> Response | dict:
    check_common(body, chat=False, served=ctx.served)
    prompts = completion_prompts(body)
    params = sampling_params(body, chat=False, default_max_tokens=COMPLETIONS_MAX_TOKENS)
    items = [_prepare(ctx, p, params, body.get("cache_salt"), {"prompt_token_ids": "prompt"})
             for p in prompts]
    echo = bool(body.get("echo"))
    if echo and params.logprobs is not None:
        raise APIError("echo: echo with logprobs needs prompt logprobs, not supported yet", "echo")
    return await _run(ctx, request, body, items, chat=False, echo=echo)


async def chat(ctx: Context, request: Request, body) -> Response | dict:
    check_common(body, chat=True, served=ctx.served)
    text = render_chat(ctx, chat_messages(body), body)
    params = sampling_params(body, chat=True, default_max_tokens=None)
    rename = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs"}
    if body.get("max_completion_tokens") is not None:
        rename["max_tokens"] = "max_completion_tokens"
    ids = ctx.engine.tokenizer.encode(text, add_special_tokens=False)
    item = _prepare(ctx, {"prompt_token_ids": ids}, params, body.get("cache_salt"), rename)
    item.text = text
    return await _run(ctx, request, body, [item], chat=True, echo=False)


async def _run(ctx: Context, request: Request, body: dict, items: list[Item], *, chat: bool,
               echo: bool):
    q: asyncio.Queue = asyncio.Queue()
    streams = []
    try:
        for i, it in enumerate(items):
            streams.append(ctx.loop.submit({"prompt_token_ids": it.ids}, it.params, out=q,
                                           index=i, cache_salt=body.get("cache_salt")))
    except (QueueFull, ShuttingDown) as e:
        for s in streams:
            ctx.loop.abort(s.request_id)
        if isinstance(e, QueueFull):
            raise APIError(str(e), None, 429, "RateLimitError") from None
        raise APIError(str(e), None, 503, "ServiceUnavailableError") from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if body.get("stream"):
        return StreamingResponse(_stream(ctx, rid, body, items, streams, q, chat, echo),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    finals = await _collect(ctx, request, q, streams)
    if finals is None:  # the client went away; its requests are aborted
        return Response(status_code=499)
    fmt, choices = ctx.fmt, []
    for i, (it, out) in enumerate(zip(items, finals)):
        if any(c.finish_reason == "error" for c in out.outputs):
            raise APIError(out.error or "engine: the request failed", None, 500,
                           "InternalServerError")
        for c in out.outputs:
            lps = None
            if c.logprobs is not None:
                lps = fmt.chat_logprobs(c.logprobs) if chat else fmt.completion_logprobs(
                    c.logprobs, len(it.text or "") if echo else 0)
            idx = i * it.params.n + c.index
            if chat:
                choices.append(fmt.chat_choice(idx, c, logprobs=lps))
            else:
                text = ((it.text or "") if echo else "") + c.text
                choices.append(fmt.completion_choice(idx, c, text=text, logprobs=lps,
                                                     final=True))
    u = usage(sum(len(it.ids) for it in items),
              sum(len(c.token_ids) for o in finals for c in o.outputs),
              sum(o.num_cached_tokens for o in finals))
    resp = fmt.envelope(rid, "chat.completion" if chat else "text_completion", now(), choices, u)
    if any(it.params.prompt_logprobs is not None for it in items):
        resp["prompt_logprobs"] = [fmt.prompt_logprobs(o.prompt_logprobs) for o in finals] \
            if len(finals) > 1 else fmt.prompt_logprobs(finals[0].prompt_logprobs)
    return resp


async def _collect(ctx: Context, request: Request, q: asyncio.Queue, streams):
    """Every request's final output, in order; None if the client left."""
    finals: dict = {}
    try:
        while len(finals) < len(streams):
            try:
                i, out = await asyncio.wait_for(q.get(), 0.5)
            except asyncio.TimeoutError:
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
    return {"error": {"message": out.error or "engine: the request failed",
                      "type": "InternalServerError", "param": None, "code": 500}}


async def _stream(ctx: Context, rid: str, body: dict, items: list[Item], streams, q, chat: bool,
                  echo: bool):
    fmt = ctx.fmt
    created = now()
    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    pending = {s.index: s for s in streams}
    closed: set = set()  # (item, answer) whose final chunk is out
    offset = {(i, k): len(it.text or "") if echo else 0
              for i, it in enumerate(items) for k in range(it.params.n)}
    generated = [0] * len(items)
    cached = [0] * len(items)

    def chunk(choices):
        return sse(fmt.envelope(rid, obj, created, choices, with_usage=include_usage))

    try:
        for i, it in enumerate(items):
            for k in range(it.params.n):
                idx = i * it.params.n + k
                if chat:
                    yield chunk([{"index": idx, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                elif echo:
                    yield chunk([{"index": idx, "text": it.text or "", "logprobs": None,
                                  "finish_reason": None}])
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
                    lps = fmt.chat_logprobs(new) if chat else fmt.completion_logprobs(
                        new, offset[key])
                done = c.finish_reason is not None
                if not (c.delta_text or lps or done):
                    continue
                idx = i * items[i].params.n + c.index
                if chat:
                    choice = {"index": idx,
                              "delta": {"content": c.delta_text} if c.delta_text else {},
                              "logprobs": lps, "finish_reason": c.finish_reason if done else None,
                              "stop_reason": c.stop_reason if done else None}
                else:
                    choice = fmt.completion_choice(idx, c, text=c.delta_text, logprobs=lps,
                                                   final=done)
                offset[key] += len(c.delta_text)
                if done:
                    closed.add(key)
                yield chunk([choice])
        if include_usage:
            yield sse(fmt.envelope(rid, obj, created, [],
                                   usage(sum(len(it.ids) for it in items), sum(generated),
                                         sum(cached))))
        yield sse("[DONE]")
    finally:  # finished, or the client went away (the task is cancelled)
        for s in pending.values():
            ctx.loop.abort(s.request_id)
