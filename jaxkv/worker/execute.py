"""From the scheduler's output to device results: pack the batches (step,
penalties, token rules), pick the program, run it.

    execute(runner, scheduled, num_steps, vocab_size) -> (StepResult, stuck rows)
    dispatch(runner, scheduled, num_steps, vocab_size) -> (Pending, stuck rows)   runner.fetch it
    execute_scored(runner, sc, vocab_size) -> (target_lps, top_ids, top_lps, StepResult, stuck)

`execute_scored` runs one sequence's prompt chunk with logits at every row
(prompt log-probabilities); it also samples the chunk's last row.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxkv.worker.runner import Pending, Runner, StepResult
from jaxkv.worker.step_batch import build_penalty_batch, build_rules_batch, build_step_batch


def execute(runner: Runner, scheduled: Sequence[Any], num_steps: int,
            vocab_size: int, mirror=None) -> tuple[StepResult, list[int]]:
    """`mirror(batch, key)`, when given, runs the same batch first (a draft
    model writing its own cache)."""
    pending, stuck = dispatch(runner, scheduled, num_steps, vocab_size, mirror)
    return runner.fetch(pending), stuck


def dispatch(runner: Runner, scheduled: Sequence[Any], num_steps: int,
             vocab_size: int, mirror=None) -> tuple[Pending, list[int]]:
    """`execute` without waiting for the device."""
    batch, key = build_step_batch(scheduled, num_steps, runner.page_size, runner.buckets)
    if mirror is not None:
        mirror(batch, key)
    penalties = build_penalty_batch(scheduled, key.seqs, runner.buckets)
    rules, stuck = build_rules_batch(scheduled, key.seqs, vocab_size)
    return runner.dispatch(batch, key, len(scheduled), penalties, rules), stuck


def execute_scored(runner: Runner, sc: Any, vocab_size: int, mirror=None):
    """Rows [sc.start, sc.start + sc.num_tokens) of one sequence; row r's
    target is the token after it (0 past the known tokens)."""
    batch, key = build_step_batch([sc], 1, runner.page_size, runner.buckets)
    if mirror is not None:
        mirror(batch, key)
    penalties = build_penalty_batch([sc], 1, runner.buckets)  # only its last row samples
    rules, stuck = build_rules_batch([sc], 1, vocab_size)
    toks = sc.seq.all_token_ids
    nxt = toks[sc.start + 1:sc.start + sc.num_tokens + 1]
    targets = np.zeros(key.tokens, np.int32)
    targets[:len(nxt)] = nxt
    tgt, top_ids, top_lps, res = runner.score(batch, key, targets, penalties, rules)
    return tgt, top_ids, top_lps, res, stuck
