"""Engine outputs -> OpenAI response and stream-chunk JSON."""

from __future__ import annotations

import copy
import json
import time

from jaxkv.core.outputs import CompletionOutput, Logprob

_FLOOR = -9999.0  # JSON has no -inf; OpenAI's floor for impossible tokens


def _lp(v: float) -> float:
    return max(float(v), _FLOOR)


class Formatter:
    """Shapes outputs for one served model (the token strings come from its
    tokenizer)."""

    def __init__(self, tokenizer, model_name: str):
        self.tokenizer = tokenizer
        self.model_name = model_name

    def named(self, model_name: str | None) -> Formatter:
        """This formatter answering as `model_name` (a LoRA adapter's; None:
        the served model's)."""
        if model_name is None or model_name == self.model_name:
            return self
        other = copy.copy(self)
        other.model_name = model_name
        return other

    def token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, lps: list[Logprob], offset: int) -> dict:
        toks = [self.token_str(lp.token_id) for lp in lps]
        offsets, at = [], offset
        for t in toks:
            offsets.append(at)
            at += len(t)
        return {
            "tokens": toks,
            "token_logprobs": [_lp(lp.logprob) for lp in lps],
            "top_logprobs": [{self.token_str(t): _lp(v) for t, v in lp.top.items()} for lp in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, lps: list[Logprob]) -> dict:
        def entry(t, v):
            s = self.token_str(t)
            return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}

        return {
            "content": [
                {
                    **entry(lp.token_id, lp.logprob),
                    "top_logprobs": [entry(t, v) for t, v in lp.top.items()],
                }
                for lp in lps
            ]
        }

    def envelope(
        self, rid: str, obj: str, created: int, choices: list, usage=None, with_usage: bool = False
    ) -> dict:
        d = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": self.model_name,
            "choices": choices,
        }
        if usage is not None or with_usage:
            d["usage"] = usage
        return d

    def prompt_logprobs(self, entries) -> list | None:
        """vLLM's shape: None for the first prompt token, then {token id:
        {"logprob", "decoded_token"}} with the prompt token and the top N."""
        if entries is None:
            return None
        out = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            d = {
                str(t): {"logprob": _lp(v), "decoded_token": self.token_str(t)}
                for t, v in e.top.items()
            }
            d[str(e.token_id)] = {
                "logprob": _lp(e.logprob),
                "decoded_token": self.token_str(e.token_id),
            }
            out.append(d)
        return out

    def completion_choice(
        self, index: int, c: CompletionOutput, *, text: str, logprobs, final: bool
    ) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason if final else None,
            "stop_reason": c.stop_reason if final else None,
        }

    def chat_choice(self, index: int, c: CompletionOutput, *, logprobs) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def json_bytes(obj) -> bytes:
    """`obj` as the JSON body Starlette's JSONResponse would write (the
    caller runs this off the event loop for a large answer)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def sse(data) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def now() -> int:
    return int(time.time())
