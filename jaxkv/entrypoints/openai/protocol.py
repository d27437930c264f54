"""Request bodies of the OpenAI API -> (prompts, SamplingParams), checked
field by field; every refusal is an `APIError` whose `param` names the
field, answered as {"error": {"message", "type", "param", "code"}}.

OpenAI's names map onto SamplingParams (max_tokens / max_completion_tokens,
temperature, top_p, seed, stop, presence / frequency penalties, logprobs /
top_logprobs); every other SamplingParams field (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens) is accepted as an extra body field, as vLLM does, and
so is vLLM's `return_token_ids` (choices carry their token ids).
Fields this server does not implement are refused by name rather than
ignored, unless ignoring them changes nothing (user, a text
response_format, tool_choice "none")."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from jaxkv.core.sampling_params import SamplingParams
from jaxkv.reprs import clip, short

log = logging.getLogger("jaxkv.serve")

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}  # vLLM's older names
COMMON = {
    "model",
    "stream",
    "stream_options",
    "n",
    "user",
    "cache_salt",
    "max_tokens",
    "response_format",
    "return_token_ids",
    *GUIDED,
}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "add_generation_prompt",
    "chat_template_kwargs",
}
MAX_PROMPTS = 64  # prompts in one completions request


MAX_MESSAGE = 600  # characters of an error message: never an echo of a large field


class APIError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ):
        message = clip(str(message), MAX_MESSAGE)
        param = clip(param, 120) if isinstance(param, str) else param
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def from_value_error(e: ValueError, rename: dict[str, str] | None = None) -> APIError:
    """An engine check's ValueError ("field: what is wrong") as a 400."""
    msg = str(e)
    head = msg.split(":", 1)[0].strip()
    param = head if head.replace("_", "").isalnum() else None
    param = (rename or {}).get(param, param)
    return APIError(msg, param)


def _check_type(body: dict, name: str, types, what: str) -> None:
    v = body.get(name)
    types = types if isinstance(types, tuple) else (types,)
    if v is not None and (not isinstance(v, types) or isinstance(v, bool) and bool not in types):
        raise APIError(f"{name}: must be {what}, got {short(v)}", name)


def sampling_params(body: dict, *, chat: bool, default_max_tokens: int | None) -> SamplingParams:
    """SamplingParams from a completions or chat body (not validated yet:
    the engine's check names the field)."""
    kw: dict[str, Any] = {}
    for name in SAMPLING_FIELDS - {"max_tokens", "logprobs"}:
        if body.get(name) is not None:
            kw[name] = body[name]
    max_tokens = body.get("max_tokens")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = body["max_completion_tokens"]
    kw["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens
    if chat:
        _check_type(body, "logprobs", bool, "true or false")
        _check_type(body, "top_logprobs", int, "an integer")
        if body.get("logprobs"):
            kw["logprobs"] = body.get("top_logprobs") or 0
        elif body.get("top_logprobs"):
            raise APIError("top_logprobs: needs logprobs set to true", "top_logprobs")
    elif body.get("logprobs") is not None:
        kw["logprobs"] = body["logprobs"]
    so = structured_spec(body)
    if so is not None:
        kw["structured_outputs"] = so
    return SamplingParams(**kw)


# Fields sglang-router adds to every request it forwards, at values that ask
# for what jaxkv does anyway: ignored without a warning.
ROUTER_DEFAULTS = {
    "continue_final_message": False,
    "no_stop_trim": False,
    "return_hidden_states": False,
    "separate_reasoning": True,
    "stream_reasoning": True,
}


def check_common(
    body: Any, *, chat: bool, served: list[str], listed: list[str] | None = None
) -> None:
    """The fields every generation request shares (types, model, n).
    `served`: the names `model` may say; `listed`: those an unknown
    model's 404 names (the served model's, not every adapter's)."""
    if not isinstance(body, dict):
        raise APIError("request body: must be a JSON object", None)
    known = (CHAT_FIELDS if chat else COMPLETION_FIELDS) | SAMPLING_FIELDS
    ignored = {k for k in set(body) - known if ROUTER_DEFAULTS.get(k, ...) != body[k]}
    if ignored:  # at most 20 names: a body may hold a million
        log.warning(
            "jaxkv serve: ignoring %d unknown request fields %s",
            len(ignored),
            sorted(ignored)[:20] if len(ignored) <= 1000 else "(too many to name)",
        )
    model = body.get("model")
    if model is not None and model not in served:
        shown = (listed if listed is not None else served)[:8]
        raise APIError(
            f"model: {short(model, 200)} is not served here (served: {', '.join(shown)})",
            "model",
            status=404,
            type="NotFoundError",
        )
    _check_type(body, "stream", bool, "true or false")
    _check_type(body, "stream_options", dict, "an object")
    if body.get("stream_options") is not None:
        if not body.get("stream"):
            raise APIError("stream_options: only allowed when stream is true", "stream_options")
        _check_type(body["stream_options"], "include_usage", bool, "true or false")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise APIError(
            f"best_of: only equal to n is supported, got {short(body['best_of'])}", "best_of"
        )
    _check_type(body, "cache_salt", str, "a string")
    _check_type(body, "return_token_ids", bool, "true or false")
    for name in ("max_tokens", "max_completion_tokens"):
        _check_type(body, name, int, "an integer")
    if chat:
        _check_type(body, "add_generation_prompt", bool, "true or false")
    else:
        if body.get("suffix") is not None:
            raise APIError("suffix: not supported by this model", "suffix")
        _check_type(body, "echo", bool, "true or false")


def structured_spec(body: dict) -> dict | None:
    """SamplingParams.structured_outputs from `structured_outputs`,
    `response_format` (json_object / json_schema) or a guided_* field."""
    given = [
        k
        for k in ("structured_outputs", "response_format", *GUIDED)
        if body.get(k) is not None
        and not (
            k == "response_format" and isinstance(body[k], dict) and body[k].get("type") == "text"
        )
    ]
    if len(given) > 1:
        raise APIError(f"{given[1]}: give one of {', '.join(given)}", given[1])
    if not given:
        return None
    k = given[0]
    if k == "structured_outputs":
        return body[k]
    if k in GUIDED:
        return {GUIDED[k]: body[k]}
    rf = body[k]
    if not isinstance(rf, dict) or rf.get("type") not in ("json_object", "json_schema"):
        raise APIError(
            "response_format: type must be text, json_object or json_schema", "response_format"
        )
    if rf["type"] == "json_object":
        return {"json_object": True}
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
        raise APIError(
            "response_format: json_schema needs {'name': ..., 'schema': {...}}", "response_format"
        )
    return {"json": js["schema"]}


def completion_prompts(body: dict) -> list[Any]:
    """`prompt`: a string, a list of strings, token ids or a list of token id
    lists -> one engine prompt per entry."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return [{"prompt_token_ids": p}]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_PROMPTS:
            raise APIError(
                f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt"
            )
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in p]
    raise APIError(
        "prompt: must be a non-empty string, list of strings, list of token ids or "
        "list of token id lists",
        "prompt",
    )


def chat_messages(body: dict) -> list[dict]:
    """`messages` checked and with text parts joined: [{"role", "content"}],
    an assistant's `tool_calls` (arguments parsed) and a tool result's
    `tool_call_id` kept."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("messages: must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise APIError(
                f"messages[{i}]: must be an object with a string 'role'", f"messages[{i}].role"
            )
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise APIError(
                        f"messages[{i}].content[{j}]: only text parts "
                        "({'type': 'text', 'text': str}) are supported",
                        f"messages[{i}].content",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise APIError(
                f"messages[{i}].content: must be a string or a list of text parts",
                f"messages[{i}].content",
            )
        msg = {"role": m["role"], "content": content}
        if m["role"] == "tool":
            if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                raise APIError(
                    f"messages[{i}].tool_call_id: a tool message needs the id of the "
                    "call it answers",
                    f"messages[{i}].tool_call_id",
                )
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("tool_calls") and m["role"] == "assistant":
            msg["tool_calls"] = [
                _tool_call(c, f"messages[{i}].tool_calls[{j}]")
                for j, c in enumerate(_list(m["tool_calls"], f"messages[{i}].tool_calls"))
            ]
        out.append(msg)
    return out


def _list(v, where: str) -> list:
    if not isinstance(v, list):
        raise APIError(f"{where}: must be a list", where)
    return v


def _tool_call(c, where: str) -> dict:
    """An assistant message's tool call, its arguments parsed from JSON."""
    import json

    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise APIError(
            f"{where}: must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
            where,
        )
    args = f.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise APIError(
            f"{where}.function.arguments: not valid JSON", f"{where}.function.arguments"
        ) from None
    if not isinstance(parsed, dict):
        raise APIError(
            f"{where}.function.arguments: must be a JSON object", f"{where}.function.arguments"
        )
    return {
        "id": c.get("id") or "",
        "type": "function",
        "function": {"name": f["name"], "arguments": parsed},
    }
