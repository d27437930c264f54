"""SamplingParams: how to sample one request, with vLLM's names and defaults."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jaxkv.reprs import short


def _opt(default, help: str, **meta):
    """A field with its help text (the CLI builds its options from these)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass
class SamplingParams:
    """How to sample one request, with vLLM's names and defaults.

    temperature 0 is greedy; top_k <= 0 (or -1) and top_p 1 and min_p 0 are
    off; penalties 0 / 0 / 1 are off. `seed` fixes the draw (a request
    without one gets a random seed at admission). `logprobs` N returns the
    chosen token's log-probability and the N most likely tokens per step.
    `stop` strings end the request and are cut from the text; `stop_token_ids`
    end it too; `ignore_eos` keeps going past the model's end token.
    """

    max_tokens: int = _opt(16, "most new tokens per answer")
    temperature: float = _opt(1.0, "0 is greedy")
    top_k: int = _opt(0, "keep the k most likely tokens (0 or -1: off)")
    top_p: float = _opt(1.0, "nucleus sampling mass (1: off)")
    min_p: float = _opt(0.0, "drop tokens below min-p x the top probability (0: off)")
    presence_penalty: float = _opt(0.0, "subtract from tokens already in the output (0: off)")
    frequency_penalty: float = _opt(0.0, "subtract per occurrence in the output (0: off)")
    repetition_penalty: float = _opt(
        1.0, "divide logits of tokens seen in prompt or output (1: off)"
    )
    stop: Sequence[str] | str | None = _opt(None, "stop string (repeatable); cut from the output")
    stop_token_ids: Sequence[int] | None = _opt(None, "token id that ends the answer (repeatable)")
    seed: int | None = _opt(None, "seed for reproducible sampling")
    logprobs: int | None = _opt(None, "return the N most likely tokens' log-probabilities per step")
    ignore_eos: bool = _opt(False, "keep going past the model's end token")
    min_tokens: int = _opt(0, "no stop before this many new tokens")
    skip_special_tokens: bool = _opt(True, "leave special tokens out of the text")
    n: int = _opt(1, "answers per prompt (the prompt's pages are computed once and shared)")
    structured_outputs: dict | None = _opt(
        None,
        "constrain the answer: a JSON object with one of json (a JSON schema), regex, "
        "choice (a list of strings), grammar (Lark), json_object (true)",
        parse="json",
    )
    allowed_token_ids: Sequence[int] | None = _opt(
        None, "only these token ids may be generated (repeatable)"
    )
    bad_words: Sequence[str] | None = _opt(None, "a word never generated (repeatable)")
    logit_bias: dict | None = _opt(
        None, "added to the logits: a JSON object token id -> bias in [-100, 100]", parse="json"
    )
    prompt_logprobs: int | None = _opt(
        None,
        "return each prompt token's log-probability and the N most likely tokens at its position",
    )

    MAX_LOGPROBS = 20
    MAX_N = 64
    MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""

        def num(name, lo=None, hi=None, lo_open=False, integer=False):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or (integer and not isinstance(v, int))
                or (isinstance(v, float) and not math.isfinite(v))
            ):
                raise ValueError(
                    f"{name}: must be a finite {'integer' if integer else 'number'}, got {short(v)}"
                )
            if lo is not None and (v <= lo if lo_open else v < lo):
                raise ValueError(f"{name}: must be {'>' if lo_open else '>='} {lo}, got {short(v)}")
            if hi is not None and v > hi:
                raise ValueError(f"{name}: must be <= {hi}, got {short(v)}")

        num("max_tokens", 1, integer=True)
        num("temperature", 0.0)
        num("top_k", -1, integer=True)
        num("top_p", 0.0, 1.0, lo_open=True)
        num("min_p", 0.0, 1.0)
        num("presence_penalty", -2.0, 2.0)
        num("frequency_penalty", -2.0, 2.0)
        num("repetition_penalty", 0.0, lo_open=True)
        num("min_tokens", 0, integer=True)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool)
        ):
            raise ValueError(f"seed: must be an integer, got {short(self.seed)}")
        if self.logprobs is not None:
            num("logprobs", 0, self.MAX_LOGPROBS, integer=True)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {short(getattr(self, name))}")
        if not (self.stop is None or isinstance(self.stop, (str, list, tuple))):
            raise ValueError(f"stop: must be a string or a list of strings, got {short(self.stop)}")
        for s in self.stop_list:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: stop strings must be non-empty strings, got {short(s)}")
            if not is_unicode(s):
                raise ValueError(f"stop: {short(s)} is not valid Unicode text (a lone surrogate)")
        self._validate_rules(vocab_size)
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple))):
            raise ValueError(
                f"stop_token_ids: must be a list of token ids, got {short(self.stop_token_ids)}"
            )
        for t in self.stop_token_ids or ():
            if (
                not isinstance(t, int)
                or isinstance(t, bool)
                or t < 0
                or (vocab_size is not None and t >= vocab_size)
            ):
                raise ValueError(f"stop_token_ids: {short(t)} is not a token id of this model")

    def _validate_rules(self, vocab_size: int | None) -> None:
        """n, structured outputs, allowed / bad tokens, logit bias, prompt
        logprobs (types and ranges; a grammar is checked when compiled)."""

        def token_id(t) -> bool:
            return (
                isinstance(t, int)
                and not isinstance(t, bool)
                and t >= 0
                and (vocab_size is None or t < vocab_size)
            )

        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= self.MAX_N:
            raise ValueError(f"n: must be an integer in [1, {self.MAX_N}], got {short(self.n)}")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS
        ):
            raise ValueError(
                f"prompt_logprobs: must be an integer in [0, {self.MAX_LOGPROBS}], "
                f"got {short(self.prompt_logprobs)}"
            )
        so = self.structured_outputs
        if so is not None:
            from jaxkv.core.structured import check_spec

            check_spec(so)
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or not all(map(token_id, ids)):
                raise ValueError(
                    f"allowed_token_ids: must be a non-empty list of token ids of "
                    f"this model, got {short(ids)}"
                )
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(
                isinstance(w, str) and w and is_unicode(w) for w in words
            ):
                raise ValueError(
                    f"bad_words: must be a list of non-empty strings, got {short(words)}"
                )
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or len(bias) > self.MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias: must be an object of at most "
                    f"{self.MAX_LOGIT_BIAS} token id -> bias entries"
                )
            for k, v in bias.items():
                t = (
                    int(k)
                    if isinstance(k, str) and k.strip().isascii() and k.strip().isdigit()
                    else k
                )
                if not token_id(t):
                    raise ValueError(f"logit_bias: {short(k)} is not a token id of this model")
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not (-100 <= v <= 100):
                    raise ValueError(
                        f"logit_bias: the bias of {short(k)} must be a number in "
                        f"[-100, 100], got {short(v)}"
                    )

    @property
    def logit_bias_pairs(self) -> list[tuple[int, float]]:
        """logit_bias as sorted (token id, bias) pairs (JSON keys are strings)."""
        return sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items())

    @property
    def uses_rules(self) -> bool:
        """Whether the logits go through a host-built mask or bias (structured
        outputs, allowed tokens, bad words, logit bias)."""
        return bool(
            self.structured_outputs is not None
            or self.allowed_token_ids
            or self.bad_words
            or self.logit_bias
        )

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


def is_unicode(text: str) -> bool:
    """False for a str holding a lone surrogate (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
