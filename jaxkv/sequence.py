"""Host-side request state: SamplingParams, Sequence, and the outputs the
engine hands back (shaped like vLLM's RequestOutput / CompletionOutput)."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from typing import Any, Sequence as Seq


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

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Seq[str] | str | None = None
    stop_token_ids: Seq[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True

    MAX_LOGPROBS = 20

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field."""
        def num(name, lo=None, hi=None, lo_open=False, integer=False):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (
                    integer and not isinstance(v, int)) or (isinstance(v, float) and math.isnan(v)):
                raise ValueError(f"{name}: must be {'an integer' if integer else 'a number'}, got {v!r}")
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
        for s in self.stop_list:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids or ():
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
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


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Logprob:
    """One step's log-probabilities: the chosen token's and the top N."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    stop_reason: int | str | None = None  # the stop string or stop token id
    logprobs: list[Logprob] | None = None
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


class Sequence:
    """A request's state on the host: tokens, how many have K/V in the
    cache, status, and what has been streamed out so far."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.status = Status.WAITING
        self.num_computed = 0  # tokens whose K/V is in the cache
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
        self.text = ""
        self.sent_tokens = 0
        self.sent_text = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        self.t_arrival = time.perf_counter()
        self.t_first_token: float | None = None
        self.t_finish: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, stop_reason=None, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.t_finish = time.perf_counter()
