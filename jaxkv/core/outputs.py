"""What the engine hands back, shaped like vLLM's RequestOutput /
CompletionOutput.

An output made while a request runs costs O(new tokens), not O(length):
it carries the deltas since the request's previous output
(`delta_text`, `delta_token_ids`, `delta_logprobs`) and builds the
cumulative `text`, `token_ids`, `logprobs` (and the request's
`prompt_token_ids`) only when they are read, from a snapshot of the
request's append-only state taken when the output was made. A final
output is read the same way, and reads the same as if it had been built
whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Logprob:
    """One step's log-probabilities: the chosen token's and the top N."""

    token_id: int
    logprob: float
    top: dict[int, float]


class CompletionOutput:
    """One sequence of a request. `text`, `token_ids` and `logprobs` are
    everything so far (text held back where a stop string may be
    starting or a character is incomplete); the `delta_*` fields are new
    since the previous output. Any field may be given a value or, for the
    cumulative three, a zero-argument function that builds it."""

    __slots__ = (
        "index",
        "_text",
        "_token_ids",
        "finish_reason",
        "stop_reason",
        "_logprobs",
        "delta_text",
        "delta_token_ids",
        "delta_logprobs",
    )

    def __init__(
        self,
        index: int,
        text: Any = "",
        token_ids: Any = (),
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        logprobs: Any = None,
        delta_text: str = "",
        delta_token_ids: Any = (),
        delta_logprobs: list[Logprob] | None = None,
    ):
        self.index = index
        self._text = text
        self._token_ids = token_ids if callable(token_ids) else list(token_ids)
        self.finish_reason = finish_reason  # "stop" | "length" | "abort" | "error" | None
        self.stop_reason = stop_reason  # the stop string or stop token id
        self._logprobs = logprobs
        self.delta_text = delta_text
        self.delta_token_ids = list(delta_token_ids)
        self.delta_logprobs = delta_logprobs

    @property
    def text(self) -> str:
        if callable(self._text):
            self._text = self._text()
        return self._text

    @property
    def token_ids(self) -> list[int]:
        if callable(self._token_ids):
            self._token_ids = self._token_ids()
        return self._token_ids

    @property
    def logprobs(self) -> list[Logprob] | None:
        if callable(self._logprobs):
            self._logprobs = self._logprobs()
        return self._logprobs

    def _fields(self) -> tuple:
        return (
            self.index,
            self.text,
            self.token_ids,
            self.finish_reason,
            self.stop_reason,
            self.logprobs,
            self.delta_text,
            self.delta_token_ids,
        )

    def __eq__(self, other) -> bool:
        return isinstance(other, CompletionOutput) and self._fields() == other._fields()

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, finish_reason={self.finish_reason!r}, "
            f"stop_reason={self.stop_reason!r}, delta_text={self.delta_text!r})"
        )


class RequestOutput:
    """A request's outputs (one CompletionOutput per sequence of n > 1).
    `prompt_token_ids` and `prompt_logprobs` (one entry per prompt token,
    None for the first; set once the prompt is computed) may be given as
    functions that build them on first read."""

    __slots__ = (
        "request_id",
        "prompt",
        "_prompt_token_ids",
        "outputs",
        "finished",
        "error",
        "num_cached_tokens",
        "metrics",
        "_prompt_logprobs",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: Any,
        outputs: list[CompletionOutput],
        finished: bool,
        error: str | None = None,
        num_cached_tokens: int = 0,
        metrics: dict[str, Any] | None = None,
        prompt_logprobs: Any = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self._prompt_token_ids = (
            prompt_token_ids if callable(prompt_token_ids) else list(prompt_token_ids)
        )
        self.outputs = outputs
        self.finished = finished
        self.error = error
        self.num_cached_tokens = num_cached_tokens
        self.metrics = metrics if metrics is not None else {}
        self._prompt_logprobs = prompt_logprobs

    @property
    def prompt_token_ids(self) -> list[int]:
        if callable(self._prompt_token_ids):
            self._prompt_token_ids = self._prompt_token_ids()
        return self._prompt_token_ids

    @property
    def prompt_logprobs(self):
        if callable(self._prompt_logprobs):
            self._prompt_logprobs = self._prompt_logprobs()
        return self._prompt_logprobs

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, finished={self.finished}, "
            f"error={self.error!r}, outputs={self.outputs})"
        )
