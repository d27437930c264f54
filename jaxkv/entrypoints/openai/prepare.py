"""A request body -> the engine requests it makes: fields checked, chat
template rendered, prompts tokenized, each request checked by the engine
(which compiles a structured output's grammar). This is the slow part of a
request, O(body), so the handlers run it in a worker thread
(`asyncio.to_thread`) and the event loop goes on serving /health and the
streams in flight. It reads only what is safe off the engine thread: the
engine's fixed settings, its tokenizer and `check_request` (its grammar
cache takes a lock); never the scheduler or the pool.

`tokenizers` holds the GIL through a single `encode` but releases it in
`encode_batch`, so text goes through the batch call: a long prompt then
costs a core, not the whole process."""

from __future__ import annotations

import dataclasses
import uuid

from jaxkv.core.requests import parse_prompt
from jaxkv.core.sampling_params import SamplingParams, is_unicode
from jaxkv.entrypoints.openai import tools as tools_mod
from jaxkv.entrypoints.openai.protocol import (
    APIError,
    chat_messages,
    check_common,
    completion_prompts,
    from_value_error,
    sampling_params,
)
from jaxkv.entrypoints.openai.responses import now
from jaxkv.entrypoints.openai.tool_grammar import grammar

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass
class Context:
    engine: object
    loop: object  # EngineLoop
    fmt: object  # Formatter
    served: list[str]
    created: int = dataclasses.field(default_factory=now)
    tool_parser: str | None = None  # None: by the model's family (`tool_parser`)
    reasoning_parser: str | None = None  # jaxkv.entrypoints.openai.reasoning (None: off)
    model_path: str | None = None  # what the model was loaded from (router info)
    disaggregation_mode: str = "null"  # this server's side of a prefill/decode split
    instance_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)

    def parser(self) -> str:
        """The tool-call format: as configured, else Llama 3's JSON for a
        template that speaks it, else hermes blocks (Qwen's, and the fallback's)."""
        if self.tool_parser:
            return self.tool_parser
        tok = self.engine.tokenizer
        template = getattr(tok, "chat_template", None) or ""
        return "llama3_json" if "<|python_tag|>" in template else "hermes"

    def models(self) -> list[str]:
        """The names a request's `model` may say: the served names, then the
        LoRA adapters known now (`lora_routes`)."""
        loras = self.engine.loras
        return self.served + ([n for n in loras.names() if n not in self.served] if loras else [])

    def adapter(self, body) -> str | None:
        """The LoRA adapter a checked body's `model` names (None: the base)."""
        model = body.get("model")
        return None if model is None or model in self.served else model

    def resolve(self, name: str | None):
        """The `jaxkv.core.adapters.lora.Adapter` of adapter `name` with its factors
        (read again from its folder here, in the handler's worker thread,
        when the host cache dropped them; never on the engine thread)."""
        if name is None:
            return None
        try:
            return self.engine.loras.resolve(name)
        except ValueError as e:
            raise APIError(f"model: {str(e)[:300]}", "model", 404, "NotFoundError") from None


@dataclasses.dataclass
class Item:
    """One engine request of an HTTP call."""

    text: str | None  # the prompt text (echo, chat)
    ids: list[int]
    params: SamplingParams
    tools: tools_mod.Tools | None = None  # a chat request's tools
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    adapter: object = None  # its `jaxkv.core.adapters.lora.Adapter`, factors read


def encode(tok, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tok.encode(text)`, with the GIL released where the tokenizer allows."""
    inner = getattr(tok, "tokenizer", None)
    if hasattr(inner, "encode_batch"):
        return inner.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tok.encode(text, add_special_tokens=add_special_tokens)


def decode(tok, ids: list[int], skip_special_tokens: bool = False) -> str:
    """`tok.decode(ids)`, with the GIL released where the tokenizer allows."""
    inner = getattr(tok, "tokenizer", None)
    if hasattr(inner, "decode_batch"):
        return inner.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _Releasing:
    """The tokenizer as `parse_prompt` calls it, through `encode` above."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return encode(self.tok, text, add_special_tokens)


def _fits(n: int, max_model_len: int) -> None:
    """A prompt of n tokens leaves room for one more, checked before the
    O(n) checks so an oversized prompt is refused at the cost of its length."""
    if n >= max_model_len:
        raise ValueError(
            f"prompt: {n} prompt tokens leave no room to generate within the "
            f"maximum model length {max_model_len}"
        )


def _prepare(ctx: Context, prompt, params: SamplingParams, salt, rename, echo: bool) -> Item:
    eng = ctx.engine
    tok = eng.tokenizer
    try:
        raw = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if isinstance(raw, list):
            _fits(len(raw), eng.max_model_len)
        text, ids = parse_prompt(
            prompt, _Releasing(tok) if tok is not None else None, eng.model_config.vocab_size
        )
        _fits(len(ids), eng.max_model_len)
        if params.max_tokens is None:  # the rest of the context
            params = dataclasses.replace(params, max_tokens=max(1, eng.max_model_len - len(ids)))
        eng.check_request({"prompt_token_ids": ids}, params, salt)
    except ValueError as e:
        raise from_value_error(e, rename) from None
    except TypeError as e:
        raise APIError(f"request: {e}") from None
    if echo and text is None and tok is not None:
        text = decode(tok, ids)
    return Item(text, ids, params)


def render_chat(ctx: Context, messages: list[dict], body: dict, tools=None) -> str:
    tok = ctx.engine.tokenizer
    if tok is None or not tok.chat_template:
        raise APIError("messages: this model has no chat template; use /v1/completions", "messages")
    for i, m in enumerate(messages):
        if not is_unicode(m["content"]) or not is_unicode(m["role"]):
            raise APIError(
                f"messages[{i}]: not valid Unicode text (a lone surrogate)",
                f"messages[{i}].content",
            )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError("chat_template_kwargs: must be an object", "chat_template_kwargs")
    messages, extra = tools_mod.for_template(
        messages, tools, tools_mod.template_renders_tools(tok.chat_template)
    )
    try:
        return tok.apply_chat_template(
            messages,
            add_generation_prompt=body.get("add_generation_prompt", True),
            **{**extra, **kwargs},
        )
    except (ValueError, TypeError) as e:
        raise APIError(f"messages: the chat template refused them ({e})", "messages") from None


def completion_items(ctx: Context, body) -> tuple[list[Item], bool]:
    """(the engine requests of a /v1/completions body, echo)."""
    check_common(body, chat=False, served=ctx.models(), listed=ctx.served)
    prompts = completion_prompts(body)
    params = sampling_params(body, chat=False, default_max_tokens=COMPLETIONS_MAX_TOKENS)
    echo = bool(body.get("echo"))
    if echo and params.logprobs is not None:
        raise APIError("echo: echo with logprobs needs prompt logprobs, not supported yet", "echo")
    items = [
        _prepare(ctx, p, params, body.get("cache_salt"), {"prompt_token_ids": "prompt"}, echo)
        for p in prompts
    ]
    lora = ctx.adapter(body)
    adapter = ctx.resolve(lora)
    for it in items:
        it.lora, it.adapter = lora, adapter
    return items, echo


def chat_items(ctx: Context, body) -> list[Item]:
    """The engine request of a /v1/chat/completions body."""
    check_common(body, chat=True, served=ctx.models(), listed=ctx.served)
    tools = tools_mod.check_tools(body, ctx.parser())
    text = render_chat(ctx, chat_messages(body), body, tools)
    params = sampling_params(body, chat=True, default_max_tokens=None)
    if tools is not None and tools.forced:  # the answer is calls: a grammar makes sure
        if params.structured_outputs is not None:
            raise APIError(
                "tool_choice: a forced tool call cannot be combined with "
                "response_format or structured outputs",
                "tool_choice",
            )
        params = dataclasses.replace(params, structured_outputs={"grammar": grammar(tools)})
    rename = {"prompt": "messages", "prompt_token_ids": "messages", "logprobs": "top_logprobs"}
    if body.get("max_completion_tokens") is not None:
        rename["max_tokens"] = "max_completion_tokens"
    ids = encode(ctx.engine.tokenizer, text, add_special_tokens=False)
    item = _prepare(
        ctx, {"prompt_token_ids": ids}, params, body.get("cache_salt"), rename, echo=False
    )
    item.text, item.tools, item.lora = text, tools, ctx.adapter(body)
    item.adapter = ctx.resolve(item.lora)
    return [item]


def _tokenizer(engine):
    if engine.tokenizer is None:
        raise APIError("this model has no tokenizer", None)
    return engine.tokenizer


def tokenize(ctx: Context, body) -> dict:
    """POST /tokenize: `prompt` or `messages` (with `tools`,
    `chat_template_kwargs`) -> token ids."""
    tok = _tokenizer(ctx.engine)
    if not isinstance(body, dict):
        raise APIError("request body: must be a JSON object")
    add_special = body.get("add_special_tokens", "messages" not in body)
    if not isinstance(add_special, bool):
        raise APIError("add_special_tokens: must be true or false", "add_special_tokens")
    if "messages" in body:  # rendered as a chat request would be, tools too
        text = render_chat(
            ctx, chat_messages(body), body, tools_mod.check_tools(body, ctx.parser())
        )
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise APIError("prompt: must be a string", "prompt")
    if not is_unicode(text):
        raise APIError("prompt: not valid Unicode text (a lone surrogate)", "prompt")
    try:
        ids = encode(tok, text, add_special_tokens=add_special)
    except (TypeError, ValueError) as e:
        raise APIError(f"prompt: cannot be tokenized ({e})", "prompt") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": ctx.engine.max_model_len}


def detokenize(ctx: Context, body) -> dict:
    """POST /detokenize: `tokens` -> text."""
    tok = _tokenizer(ctx.engine)
    if not isinstance(body, dict):
        raise APIError("request body: must be a JSON object")
    ids = body.get("tokens")
    vocab = ctx.engine.model_config.vocab_size
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
    ):
        raise APIError(f"tokens: must be a list of token ids below {vocab}", "tokens")
    return {"prompt": decode(tok, ids)}
