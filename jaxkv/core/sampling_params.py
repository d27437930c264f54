"""SamplingParams: how to sample one request, with vLLM's names and defaults."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence


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
    repetition_penalty: float = _opt(1.0, "divide logits of tokens seen in prompt or output "
                                          "(1: off)")
    stop: Sequence[str] | str | None = _opt(None, "stop string (repeatable); cut from the output")
    stop_token_ids: Sequence[int] | None = _opt(None, "token id that ends the answer "
                                                      "(repeatable)")
    seed: int | None = _opt(None, "seed for reproducible sampling")
    logprobs: int | None = _opt(None, "return the N most likely tokens' log-probabilities "
                                      "per step")
    ignore_eos: bool = _opt(False, "keep going past the model's end token")
    min_tokens: int = _opt(0, "no stop before this many new tokens")
    skip_special_tokens: bool = _opt(True, "leave special tokens out of the text")

    MAX_LOGPROBS = 20

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""
        def num(name, lo=None, hi=None, lo_open=False, integer=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                    integer and not isinstance(v, int)) or (
                    isinstance(v, float) and not math.isfinite(v)):
                raise ValueError(f"{name}: must be a finite {'integer' if integer else 'number'}, "
                                 f"got {v!r}")
            if lo is not None and (v <= lo if lo_open else v < lo):
                raise ValueError(f"{name}: must be {'>' if lo_open else '>='} {lo}, got {v!r}")
            if hi is not None and v > hi:
                raise ValueError(f"{name}: must be <= {hi}, got {v!r}")

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
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed: must be an integer, got {self.seed!r}")
        if self.logprobs is not None:
            num("logprobs", 0, self.MAX_LOGPROBS, integer=True)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        if not (self.stop is None or isinstance(self.stop, (str, list, tuple))):
            raise ValueError(f"stop: must be a string or a list of strings, got {self.stop!r}")
        for s in self.stop_list:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: stop strings must be non-empty strings, got {s!r}")
            if not is_unicode(s):
                raise ValueError(f"stop: {s!r} is not valid Unicode text (a lone surrogate)")
        if not (self.stop_token_ids is None or isinstance(self.stop_token_ids, (list, tuple))):
            raise ValueError(f"stop_token_ids: must be a list of token ids, "
                             f"got {self.stop_token_ids!r}")
        for t in self.stop_token_ids or ():
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (
                    vocab_size is not None and t >= vocab_size):
                raise ValueError(f"stop_token_ids: {t!r} is not a token id of this model")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def is_unicode(text: str) -> bool:
    """False for a str holding a lone surrogate (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
