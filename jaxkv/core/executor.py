"""From the scheduler's output to the worker and back: each step's
sequences packed into one `StepPlan` (`jaxkv.core.plan_builder`), mirrored
into a draft model's cache when there is one, run by the Runner, read
back as a `StepResult`.

    executor.dispatch(scheduled, num_steps) -> (Pending, stuck)   runner.fetch it
    executor.run(scheduled, num_steps) -> (StepResult, stuck)
    executor.score(sc) -> (ScoreResult, stuck)   a prompt chunk with logits at every row

`stuck` lists the sequences whose token rules allow no token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.core.kv.tiers import apply_transfers
from jaxkv.core.plan_builder import build_plan
from jaxkv.worker.plan import ScoreResult, StepPlan, StepResult
from jaxkv.worker.runner import Pending, Runner


class Executor:
    """`draft`: a `jaxkv.core.spec.draft_model.DraftProposer` whose cache follows
    every step and page copy the target runs (None without one)."""

    def __init__(self, runner: Runner, vocab_size: int, draft=None, tier=None, evictor=None):
        self.runner = runner
        self.vocab_size = vocab_size
        self.draft = draft
        self.tier = tier  # a kv_tiers.HostTier, or None
        self.evictor = evictor  # a kv_evict.Evictor, or None

    def plan(self, scheduled: Sequence, num_steps: int) -> tuple[StepPlan, list[int]]:
        b = self.runner.buckets
        plan, stuck = build_plan(
            scheduled,
            num_steps,
            pages_per_seq=b.pages_per_seq,
            vocab_size=self.vocab_size,
            history_width=b.history_width,
        )
        if self.evictor is not None:
            self.evictor.annotate(plan, scheduled)
        return plan, stuck

    def copy_pages(self, pairs) -> None:
        self.runner.copy_pages(pairs)
        if self.draft is not None:
            self.draft.copy_pages(pairs)

    def apply_copies(self, sched) -> None:
        """A scheduler output's page moves, before its step: host-tier
        copies out and loads in, copy-on-write pages, and a hybrid pool's
        ring copies (the target's only)."""
        if sched.transfers:
            apply_transfers(self.runner, self.tier, sched.transfers)
        self.copy_pages(sched.copies)
        if sched.local_copies:
            self.runner.copy_pages(sched.local_copies, local=True)

    def dispatch(self, scheduled: Sequence, num_steps: int) -> tuple[Pending, list[int]]:
        plan, stuck = self.plan(scheduled, num_steps)
        if self.draft is not None:
            self.draft.mirror(plan, self.runner.key_for(plan))
        return self.runner.dispatch(plan), stuck

    def run(self, scheduled: Sequence, num_steps: int) -> tuple[StepResult, list[int]]:
        pending, stuck = self.dispatch(scheduled, num_steps)
        res = self.runner.fetch(pending)
        if self.draft is not None:  # an EAGLE-3 head reads the step's features and tokens
            self.draft.follow(scheduled, pending, res)
        return res, stuck

    def score(self, sc) -> tuple[ScoreResult, list[int]]:
        """Rows [sc.start, sc.start + sc.num_rows) of one sequence; row r's
        target is the token after it (0 past the known tokens)."""
        plan, stuck = self.plan([sc], 1)
        if self.draft is not None:
            self.draft.mirror(plan, self.runner.key_for(plan))
        toks = sc.seq.all_token_ids
        targets = np.zeros(sc.num_rows, np.int32)
        nxt = toks[sc.start + 1 : sc.start + sc.num_rows + 1]
        targets[: len(nxt)] = nxt
        return self.runner.score(plan, targets), stuck
