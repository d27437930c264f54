"""What crosses between the host core and the worker: one typed plan per
step in, one typed result out. Numpy only; the worker never sees a
request or a sequence object.

    StepPlan     the live rows and sequences of a step (no padding)
    StepResult   the sampled tokens of each live sequence
    ScoreResult  a scored prompt chunk's log-probabilities (prompt_logprobs)

Shapes: T the step's live rows, S its live sequences, W pages per sequence
(`Buckets.pages_per_seq`), N top log-probabilities, n the model calls a
step ran (or k + 1 rows of a verify step).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.worker.step_batch import PenaltyBatch, RulesBatch, SamplingBatch
from jaxkv.worker.stop import StopBatch


@dataclasses.dataclass
class StepPlan:
    """One step's rows and sequences, in order: sequence s owns rows
    sum(q_lens[:s]) : sum(q_lens[:s + 1]) and computes positions
    starts[s] .. starts[s] + q_lens[s] - 1 (K/V written there; kv_len is
    starts + q_lens).

    token_ids [T]       input token of each row; its last num_spec[s] rows
                        are proposals (speculative decoding)
    starts [S]          position of the sequence's first row
    q_lens [S]          rows of the sequence
    num_spec [S]        proposals among its rows (0: none)
    prev_index [S]      -1, or (overlapped scheduling, one row) the index of
                        the sequence in the previous step, whose newest
                        sampled token the device takes as this row's input
    block_tables [S, W] the sequence's pages (0 past its last)
    num_output [S]      output tokens before this step (the sampler's seed
                        stream index, the stop rules)
    sampling, stops     per-sequence sampling options and stop rules [S]
    num_steps           decode steps to run (> 1: every sequence one row)
    penalties, rules    per-sequence penalty history / token rules, or None
                        when no sequence of the step has any
    """

    token_ids: np.ndarray
    starts: np.ndarray
    q_lens: np.ndarray
    num_spec: np.ndarray
    prev_index: np.ndarray
    block_tables: np.ndarray
    num_output: np.ndarray
    sampling: SamplingBatch
    stops: StopBatch
    num_steps: int = 1
    penalties: PenaltyBatch | None = None
    rules: RulesBatch | None = None
    ring_base: np.ndarray | None = None  # [S] first page of each sequence's ring (hybrid pool)
    lora_slots: np.ndarray | None = None  # [S] each sequence's LoRA slot + 1 (0: none)
    # Importance eviction (else None): [S] tokens dropped before `starts` (starts, the
    # block tables and kv_lens count kept tokens; RoPE positions add this), and the
    # kv index from which rows are scored (`jaxkv.model.kv_scores`).
    pos_offset: np.ndarray | None = None
    score_from: np.ndarray | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_rows(self) -> int:
        return len(self.token_ids)

    @property
    def all_decode(self) -> bool:
        """Every sequence brings one row."""
        return bool(np.all(self.q_lens == 1))

    @property
    def verifies(self) -> bool:
        """Some sequence brings proposals: a verify step."""
        return bool(np.any(self.num_spec))


@dataclasses.dataclass
class StepResult:
    """A step's outputs for its live sequences: tokens / logprobs [n, S],
    top_ids / top_logprobs [n, S, N], finite [n, S] (all that row's logits
    finite); counts [S] the rows that are each sequence's tokens (n, or
    in a verify step its accepted proposals plus one)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    finite: np.ndarray
    counts: np.ndarray


@dataclasses.dataclass
class ScoreResult:
    """A prompt chunk scored at every row: target_logprobs [T] of each
    row's next token, top_ids / top_logprobs [T, N]; `step` the sample of
    its last row (a one-sequence StepResult)."""

    target_logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    step: StepResult
