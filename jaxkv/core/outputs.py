"""What the engine hands back, shaped like vLLM's RequestOutput /
CompletionOutput."""

from __future__ import annotations

import dataclasses
from typing import Any


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
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for
    # the first), set once the prompt is computed.
    prompt_logprobs: list[Logprob | None] | None = None
