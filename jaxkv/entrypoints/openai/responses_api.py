"""The Responses API: `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{id}`.

A body is made into the chat request it means and runs through the chat
path (template, tools, grammars, the same checks): `input` (a string, or
items: messages with text parts, `function_call`, `function_call_output`),
`instructions` (a system message first), function `tools` and
`tool_choice`, `max_output_tokens`, the sampling fields, `text.format`
(text, json_object, json_schema) and `previous_response_id`, whose stored
conversation comes first (so a continued conversation renders the same
prefix and finds its pages in the prefix cache). The answer's parts are
output items: `reasoning` (with `--reasoning-parser`), a `message` of
`output_text`, `function_call`s. Streamed as OpenAI's events
(`response.created`, `response.output_item.added`,
`response.output_text.delta`, `response.function_call_arguments.delta`,
..., `response.completed`), each with its `sequence_number`.

Responses are kept (unless `store: false`) for `previous_response_id` and
GET, within the bounds of `responses_store` (which also bounds what a
response echoes: metadata, text.format, ids); DELETE forgets one. Large
answers are written as JSON in a worker thread, never on the event loop. Not supported, refused by
name: built-in tools (web search, files, computer use), `background`,
image or file inputs, `conversation`."""

from __future__ import annotations

import asyncio
import json

from fastapi.responses import Response, StreamingResponse

from jaxkv.entrypoints.openai import generate, tool_stream
from jaxkv.entrypoints.openai.prepare import chat_items
from jaxkv.entrypoints.openai.protocol import SAMPLING_FIELDS, APIError
from jaxkv.entrypoints.openai.reasoning import Reasoning
from jaxkv.entrypoints.openai.responses import json_bytes, now, sse
from jaxkv.entrypoints.openai.responses_output import Output
from jaxkv.entrypoints.openai.responses_output import new_id as _new_id
from jaxkv.entrypoints.openai.responses_store import Store, check_fields
from jaxkv.reprs import short

PASSED = {
    "model",
    "temperature",
    "top_p",
    "stream",
    "user",
    "cache_salt",
    "parallel_tool_calls",
    "chat_template_kwargs",
} | (SAMPLING_FIELDS - {"max_tokens", "logprobs"})
REFUSED = ("background", "conversation", "prompt")


def chat_body(body, store: Store) -> tuple[dict, list[dict]]:
    """(the chat body a Responses body means, its conversation so far)."""
    if not isinstance(body, dict):
        raise APIError("request body: must be a JSON object")
    for k in REFUSED:
        if body.get(k):
            raise APIError(f"{k}: not supported by this server", k)
    check_fields(body)
    history: list[dict] = []
    prev = body.get("previous_response_id")
    if prev is not None:
        got = store.get(prev)
        if got is None:
            raise APIError(
                f"previous_response_id: no stored response {short(prev)}",
                "previous_response_id",
                404,
                "NotFoundError",
            )
        history = list(got[1])
    conversation = history + _input(body.get("input"))  # instructions are the turn's own
    system = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise APIError("instructions: must be a string", "instructions")
        system = [{"role": "system", "content": body["instructions"]}]
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["messages"] = system + conversation
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    tc = body.get("tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function":
        tc = {"type": "function", "function": {"name": tc.get("name")}}
    if tc is not None:
        chat["tool_choice"] = tc
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")},
        }
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise APIError("text.format: type must be text, json_object or json_schema", "text.format")
    return chat, conversation


def _input(inp) -> list[dict]:
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    if not isinstance(inp, list) or not inp:
        raise APIError("input: must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where}: must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again
        else:
            raise APIError(
                f"{where}.type: {short(kind)} items are not supported (message, "
                "function_call, function_call_output)",
                f"{where}.type",
            )
    return out


def _text(content, where: str):
    if isinstance(content, str) or not isinstance(content, list):
        return content
    parts = []
    for j, p in enumerate(content):
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            raise APIError(
                f"{where}.content[{j}]: only text parts are supported", f"{where}.content[{j}].type"
            )
        parts.append(p.get("text"))
    return [{"type": "text", "text": t} for t in parts]


def _tools(tools) -> list:
    if not isinstance(tools, list):
        raise APIError("tools: must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(
                f"tools[{i}].type: only function tools are supported, got {short(kind)}",
                f"tools[{i}].type",
            )
        out.append(
            {
                "type": "function",
                "function": {k: t[k] for k in ("name", "description", "parameters") if k in t},
            }
        )
    return out


def _skeleton(ctx, rid: str, body: dict, model: str | None) -> dict:
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    return {
        "id": rid,
        "object": "response",
        "created_at": now(),
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model or ctx.fmt.model_name,
        "output": [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": _echo_choice(body.get("tool_choice")),
        "tools": _echo_tools(body),
        "text": {"format": fmt or {"type": "text"}},
        "store": body.get("store", True) is not False,
        "metadata": body.get("metadata") or {},
        "usage": None,
    }


def _echo_tools(body: dict) -> list:
    """The request's function tools as checked (their known fields only)."""
    tools = body.get("tools") if isinstance(body.get("tools"), list) else []
    return [
        {k: t[k] for k in ("type", "name", "description", "parameters", "strict") if k in t}
        for t in tools
        if isinstance(t, dict)
    ]


def _echo_choice(tc):
    if isinstance(tc, dict):
        return {k: tc[k] for k in ("type", "name") if k in tc}
    return tc if isinstance(tc, str) else "auto"


def _finalize(resp: dict, out: Output, final, item) -> dict:
    c = final.outputs[0]
    resp["output"] = out.items
    resp["status"] = "incomplete" if c.finish_reason == "length" else "completed"
    if c.finish_reason == "length":
        resp["incomplete_details"] = {"reason": "max_output_tokens"}
    n_in, n_out = len(item.ids), len(c.token_ids)
    resp["usage"] = {
        "input_tokens": n_in,
        "output_tokens": n_out,
        "total_tokens": n_in + n_out,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    return resp


def _as_messages(items: list[dict]) -> list[dict]:
    """The answer as chat history: one assistant message (text, calls)."""
    text = "".join(i["content"][0]["text"] for i in items if i["type"] == "message")
    calls = [
        {
            "id": i["call_id"],
            "type": "function",
            "function": {"name": i["name"], "arguments": i["arguments"]},
        }
        for i in items
        if i["type"] == "function_call"
    ]
    msg = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


async def create(ctx, store: Store, request, body):
    chat, conversation = await asyncio.to_thread(chat_body, body, store)
    item = (await asyncio.to_thread(chat_items, ctx, chat))[0]
    if item.params.n != 1:
        raise APIError("n: a response has one answer", "n")
    q: asyncio.Queue = asyncio.Queue()
    stream = generate.submit_items(ctx, [item], chat, q)[0]
    rid = _new_id("resp")
    resp = _skeleton(ctx, rid, body, item.lora)
    out = Output(resp)
    thinker = Reasoning(ctx.reasoning_parser, item.text or "") if ctx.reasoning_parser else None
    parser = tool_stream.StreamParser(item.tools) if item.tools is not None else None

    def feed(delta: str, done: bool) -> list[dict]:
        thinking, content = thinker.feed(delta, done) if thinker else ("", delta)
        ev = out.text(thinking, "reasoning")
        calls = []
        if parser is not None:
            content, calls = parser.feed(content, done)
        ev += out.text(content)
        for d in calls:  # each call: its id and name, then its arguments as they come
            ev += out.call(d)
        return ev + (out.finish() if done else [])

    async def keep(final) -> dict:
        _finalize(resp, out, final, item)
        if resp["store"]:
            await asyncio.to_thread(store.put, rid, resp, conversation + _as_messages(out.items))
        return resp

    if body.get("stream"):
        return StreamingResponse(
            _events(ctx, q, stream, out, resp, feed, keep),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    finals = await generate._collect(ctx, request, q, [stream])
    if finals is None:
        return Response(status_code=499)
    c = finals[0].outputs[0]
    if c.finish_reason == "error":
        raise APIError(
            finals[0].error or "engine: the request failed", None, 500, "InternalServerError"
        )
    feed(c.text, True)
    final = await keep(finals[0])
    return Response(await asyncio.to_thread(json_bytes, final), media_type="application/json")


async def _events(ctx, q, stream, out: Output, resp: dict, feed, keep):
    finished = False
    try:
        yield await asyncio.to_thread(sse, out.event("response.created", response=dict(resp)))
        yield await asyncio.to_thread(sse, out.event("response.in_progress", response=dict(resp)))
        while not finished:
            _, o = await q.get()
            finished = o.finished
            c = o.outputs[0]
            if c.finish_reason == "error":
                resp["status"] = "failed"
                resp["error"] = {
                    "code": "server_error",
                    "message": o.error or "engine: the request failed",
                }
                yield sse(out.event("response.failed", response=resp))
                return
            for ev in feed(c.delta_text, o.finished):
                yield sse(ev)
            if o.finished:
                final = await keep(o)
                kind = (
                    "response.completed"
                    if final["status"] == "completed"
                    else "response.incomplete"
                )
                yield await asyncio.to_thread(sse, out.event(kind, response=final))
    finally:  # the client went away: its request is aborted
        if not finished:
            ctx.loop.abort(stream.request_id)
