"""What the scheduler hands the engine for one step: each running
sequence's chunk (`ScheduledSeq`: its first position, its rows, its
proposals) and the step's page copies and preemptions
(`SchedulerOutput`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxkv.core.sequence import Sequence

# Prompt rows per step of a request that wants prompt log-probabilities
# (their logits [rows, V] are computed at every row).
PROMPT_LOGPROB_CHUNK = 256


def chunk_cap(seq: Sequence, start: int) -> int:
    if seq.params.prompt_logprobs is not None and start < len(seq.prompt_token_ids):
        return PROMPT_LOGPROB_CHUNK
    return 1 << 62


@dataclasses.dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_rows: int  # rows this step (with the proposals)
    num_spec: int = 0  # rows reserved for proposals (the proposer fills spec_tokens)
    spec_tokens: tuple | list = ()  # proposals, rows 1..k (the proposer sets them)
    prev_row: int = -1  # >= 0: its one row's token comes from this row of the step before
    inflight_tokens: int = 0  # tokens the step samples for it, counted while in flight

    @property
    def known_end(self) -> int:
        """Position after the last known (not proposed) token of this chunk."""
        return self.start + self.num_rows - len(self.spec_tokens)

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's last known token, so
        the step's sample is its next token."""
        return self.known_end == self.seq.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]  # copy-on-write page pairs to apply first
    preempted: list[Sequence]
    # ring page pairs of the sliding layers (hybrid pool: forked sequences'
    # windows), applied first too
    local_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    num_steps: int = 1  # decode steps in this call (> 1: every sequence decodes)
    needs_preemption: bool = False  # a lookahead plan that could not grow a sequence
    transfers: Any = None  # host-tier page moves to run first (kv_tiers.TierTransfers)

    @property
    def num_rows(self) -> int:
        return sum(s.num_rows for s in self.scheduled)
