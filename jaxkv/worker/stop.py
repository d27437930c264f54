"""When a request stops: one rule, evaluated on the host after every token
and inside the jitted multi-step decode loop.

A request stops
- with "stop" when its newest token is an end token (the model's, unless
  `ignore_eos`) or one of its `stop_token_ids`, once it has at least
  `min_tokens` output tokens; or when its text contains a stop string
  (host only: text is not on the device);
- with "length" when it has `max_tokens` output tokens or reaches the
  engine's maximum model length.

`StopRule` is a request's rule as data; `check` is the rule over arrays
(jax.numpy in the loop), `StopRule.on_token` the same rule for one token
on the host, in plain Python (no arrays per token); a test holds the two
equal. The loop only uses it to stop early: the host check is
authoritative and drops whatever the device ran past a stop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

# Stop token ids the device sees per sequence; a request with more still
# stops exactly (on the host), its decode loop just runs on past the stop.
STOP_WIDTH = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StopBatch:
    """stop_ids[S, STOP_WIDTH] i32 (-1 padded), min_tokens[S], max_tokens[S]."""

    stop_ids: Any
    min_tokens: Any
    max_tokens: Any


def check(xp, token, num_output, stop_ids, min_tokens, max_tokens):
    """token [S] the newest tokens, num_output [S] output tokens counting
    them, stop_ids [S, N], min_tokens / max_tokens [S] -> (stopped [S] bool:
    a stop token once min_tokens are out, length [S] bool)."""
    stopped = xp.any(token[:, None] == stop_ids, axis=1) & (num_output >= min_tokens)
    return stopped, num_output >= max_tokens


@dataclasses.dataclass(frozen=True)
class StopRule:
    """One request's stop rule (see the module docstring). `max_tokens` is
    already capped by the room left in the model's context."""

    stop_token_ids: tuple[int, ...]
    min_tokens: int
    max_tokens: int
    stop_strings: tuple[str, ...] = ()

    @classmethod
    def for_request(
        cls, params, eos_token_ids: Sequence[int], prompt_len: int, max_model_len: int
    ) -> StopRule:
        ids = tuple(params.stop_token_ids or ())
        if not params.ignore_eos:
            ids = tuple(dict.fromkeys(tuple(eos_token_ids) + ids))
        return cls(
            stop_token_ids=ids,
            min_tokens=params.min_tokens,
            max_tokens=min(params.max_tokens, max_model_len - prompt_len),
            stop_strings=tuple(params.stop_list),
        )

    def on_token(self, token: int, num_output: int) -> str | None:
        """Host check after `token` became output token number `num_output`:
        "stop", "length" or None (stop strings are checked on the text)."""
        if num_output >= self.min_tokens and token in self.stop_token_ids:
            return "stop"
        return "length" if num_output >= self.max_tokens else None

    def device_ids(self) -> tuple[int, ...]:
        """The stop token ids the device loop sees (at most STOP_WIDTH)."""
        return self.stop_token_ids[:STOP_WIDTH]
