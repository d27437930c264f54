"""A request's state on the host.

Each piece of per-sequence state has one owner: the Sequence owns its
tokens, status, finish and streaming state; its `progress` (pages, K/V
slots reserved and written, tokens in flight: `jaxkv.core.progress`) is
the scheduler's, set while it runs.

Tokens live in one growing int32 array, prompt first: `all_token_ids`,
`prompt_token_ids` and `output_token_ids` are views of it (no copy), and
appending a token is O(1). A view taken earlier keeps the tokens it saw.
"""

from __future__ import annotations

import enum
import time

import numpy as np

from jaxkv.core.outputs import Logprob
from jaxkv.core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens (prompt, then output), the stop rule, status and finish reason,
    and what has been streamed out so far."""

    def __init__(
        self,
        request_id,
        prompt: str | None,
        prompt_token_ids,
        params: SamplingParams,
        seed: int,
        stop=None,
        cache_salt: str | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        n = len(prompt_token_ids)
        self._ids = np.zeros(max(16, 2 * n), np.int32)
        self._ids[:n] = prompt_token_ids
        self._len = n
        self.num_prompt_tokens = n
        self.num_output_tokens = 0
        self.params = params
        self.seed = seed
        self.stop = stop  # jaxkv.worker.stop.StopRule (None for a refused request)
        self.cache_salt = cache_salt  # prefix-cache tenant (page_pool.salted_root)
        self.rules = None  # jaxkv.core.structured.TokenRules when the request has token rules
        self.lora = None  # jaxkv.core.adapters.lora.Adapter of a request for one
        self.lora_slot = 0  # its device slot + 1 while it runs (0: the base model)
        # Parallel sampling (n > 1): the request's sequences, this one (index
        # 0, the parent) first. With fork_pending the parent prefills all
        # but the last prompt token, then the others fork its pages.
        self.index = 0
        self.parent = self
        self.children: list[Sequence] = [self]
        self.fork_pending = False
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.logprobs: list[Logprob] | None = [] if params.logprobs is not None else None
        # prompt_logprobs: entry i for prompt token i (None for the first).
        self.prompt_logprobs: list[Logprob | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.text = None  # jaxkv.core.output_processor.TextState (with a tokenizer)
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.progress = None  # jaxkv.core.progress.Progress while it runs (the scheduler's)
        # Hybrid KV pool: the first page of its seat's ring of sliding-layer
        # pages while it runs (0: no ring; see jaxkv.core.scheduling.scheduler).
        self.ring_base = 0
        # the bytes of its jaxkv.core.plan_builder.ROW_DTYPE record, built once when queued
        self.sampling_row = None
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        self.spec_proposed = 0  # speculative tokens proposed / accepted for it
        self.spec_accepted = 0
        self.t_arrival = time.perf_counter()
        self.t_first_token: float | None = None
        self.t_finish: float | None = None

    def add_child(self, index: int, seed: int, rules) -> Sequence:
        """Sequence `index` of this n > 1 request: the same prompt and
        settings, its own seed stream and rules; keyed (request id, index),
        so no caller's request id can collide with it."""
        c = Sequence(
            (self.request_id, index),
            self.prompt,
            self.prompt_token_ids,
            self.params,
            seed,
            stop=self.stop,
            cache_salt=self.cache_salt,
        )
        c.index, c.parent, c.rules = index, self, rules
        c.lora, c.lora_slot = self.lora, self.lora_slot
        c.prompt_logprobs = None  # the parent's serve the request
        self.children.append(c)
        return c

    # ------------------------------------------------------------ tokens

    def append_token(self, token: int) -> None:
        if self._len == len(self._ids):
            grown = np.zeros(2 * len(self._ids), np.int32)
            grown[: self._len] = self._ids[: self._len]
            self._ids = grown
        self._ids[self._len] = token
        self._len += 1
        self.num_output_tokens += 1

    @property
    def all_token_ids(self) -> np.ndarray:
        """Prompt and output tokens [num_tokens] (a view)."""
        return self._ids[: self._len]

    @property
    def prompt_token_ids(self) -> np.ndarray:
        return self._ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> np.ndarray:
        return self._ids[self.num_prompt_tokens : self._len]

    @property
    def last_token(self) -> int:
        return int(self._ids[self._len - 1])

    @property
    def num_tokens(self) -> int:
        """Tokens on the host (prompt and output read so far)."""
        return self._len

    @property
    def inflight_tokens(self) -> int:
        p = self.progress
        return p.inflight_tokens if p is not None else 0

    @property
    def planned_tokens(self) -> int:
        """Tokens once the steps in flight are read (`num_tokens` plus the
        tokens they sample): what the scheduler plans the next step from."""
        p = self.progress
        return self._len + (p.inflight_tokens if p is not None else 0)

    def scores_prompt(self, start: int) -> bool:
        """Whether a chunk from `start` still has prompt log-probabilities to
        compute."""
        return (
            self.prompt_logprobs is not None
            and start < self.num_prompt_tokens
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before this sequence samples (or forks)."""
        return self.planned_tokens - 1 if self.fork_pending else self.planned_tokens

    @property
    def tokens_left(self) -> int:
        """Output tokens it may still generate (beyond those in flight)."""
        return self.stop.max_tokens - self.num_output_tokens - self.inflight_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, stop_reason=None, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.t_finish = time.perf_counter()
