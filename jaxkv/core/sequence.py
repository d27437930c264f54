"""A request's state on the host.

Each piece of per-sequence state has one owner: the Sequence owns its
tokens, status, finish and streaming state; the block manager owns where
its K/V lives (its pages, the slots reserved, how many tokens are computed:
`BlockManager.block_table` / `num_tokens` / `num_computed_tokens`, keyed by
the request id) from admission until it is freed.
"""

from __future__ import annotations

import enum
import time

from jaxkv.core.outputs import Logprob
from jaxkv.core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens (prompt, then output), the stop rule, status and finish reason,
    and what has been streamed out so far."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, seed: int, stop=None, cache_salt: str | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.stop = stop  # jaxkv.worker.stop.StopRule (None for a refused request)
        self.cache_salt = cache_salt  # prefix-cache tenant (page_pool.salted_root)
        self.rules = None  # jaxkv.core.structured.TokenRules when the request has token rules
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
            [None] if params.prompt_logprobs is not None else None)
        self.text = ""
        self.sent_tokens = 0
        self.sent_text = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        # Overlapped scheduling: tokens sampled by dispatched steps the host
        # has not read yet, how many dispatched steps hold this sequence, and
        # the position after the last K/V they write (0: none in flight).
        self.ahead = 0
        self.inflight = 0
        self.inflight_end = 0
        self.spec_proposed = 0  # speculative tokens proposed / accepted for it
        self.spec_accepted = 0
        self.t_arrival = time.perf_counter()
        self.t_first_token: float | None = None
        self.t_finish: float | None = None

    def add_child(self, index: int, seed: int, rules) -> "Sequence":
        """Sequence `index` of this n > 1 request: the same prompt and
        settings, its own seed stream and rules; keyed (request id, index),
        so no caller's request id can collide with it."""
        c = Sequence((self.request_id, index), self.prompt, self.prompt_token_ids, self.params,
                     seed, stop=self.stop, cache_salt=self.cache_salt)
        c.index, c.parent, c.rules = index, self, rules
        c.prompt_logprobs = None  # the parent's serve the request
        self.children.append(c)
        return c

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Tokens on the host (prompt and output read so far)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def planned_tokens(self) -> int:
        """Tokens once the steps in flight are read (`num_tokens` + `ahead`):
        what the scheduler plans the next step from."""
        return self.num_tokens + self.ahead

    def scores_prompt(self, start: int) -> bool:
        """Whether a chunk from `start` still has prompt log-probabilities to
        compute."""
        return (self.prompt_logprobs is not None and start < len(self.prompt_token_ids)
                and len(self.prompt_logprobs) < len(self.prompt_token_ids))

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before this sequence samples (or forks)."""
        return self.planned_tokens - 1 if self.fork_pending else self.planned_tokens

    @property
    def tokens_left(self) -> int:
        """Output tokens it may still generate (beyond those in flight)."""
        return self.stop.tokens_left(len(self.output_token_ids) + self.ahead)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, stop_reason=None, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.error = error
        self.t_finish = time.perf_counter()
