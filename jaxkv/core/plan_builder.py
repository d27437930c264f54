"""The host core's side of the step plan: the scheduler's output packed into
the worker's `StepPlan` (numpy only), and each sequence's sampling row.

`seq_row` is the only place SamplingParams fields and stop rules become
arrays: once per request, when it is queued. A step then stacks the rows
of its sequences and copies their newest tokens and block table rows;
nothing in it grows with a sequence's length, save a prefill chunk's own
tokens and, for the rare sequence with penalties, its token history.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from jaxkv.worker.plan import StepPlan
from jaxkv.worker.step_batch import (
    BIAS_WIDTH,
    SAMPLING_FIELDS,
    PenaltyBatch,
    RulesBatch,
    SamplingBatch,
)
from jaxkv.worker.stop import STOP_WIDTH, StopBatch

ROW_DTYPE = np.dtype(
    [
        ("temperature", np.float32),
        ("top_k", np.int32),
        ("top_p", np.float32),
        ("min_p", np.float32),
        ("seeds", np.uint32),
        ("num_logprobs", np.int32),
        ("presence_penalty", np.float32),
        ("frequency_penalty", np.float32),
        ("repetition_penalty", np.float32),
        ("min_tokens", np.int32),
        ("max_tokens", np.int32),
        ("stop_ids", np.int32, (STOP_WIDTH,)),
    ]
)


def seq_row(params, seed: int, stop) -> bytes:
    """A sequence's sampling options and stop rule as the bytes of one
    ROW_DTYPE record (a step joins its sequences' records in one copy)."""
    row = np.zeros(1, ROW_DTYPE)
    r = row[0]
    r["temperature"], r["top_k"], r["top_p"], r["min_p"] = (
        params.temperature,
        min(params.top_k, np.iinfo(np.int32).max),
        params.top_p,
        params.min_p,
    )
    r["seeds"] = seed & 0xFFFFFFFF
    r["num_logprobs"] = params.logprobs or 0
    r["presence_penalty"], r["frequency_penalty"], r["repetition_penalty"] = (
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
    )
    ids = stop.device_ids()
    r["stop_ids"] = -1
    r["stop_ids"][: len(ids)] = ids
    r["min_tokens"], r["max_tokens"] = stop.min_tokens, stop.max_tokens
    return row.tobytes()


def build_plan(
    scheduled: Seq, num_steps: int, *, pages_per_seq: int, vocab_size: int, history_width=None
) -> tuple[StepPlan, list[int]]:
    """(the StepPlan of `scheduled` (the scheduler's ScheduledSeqs, in
    order), the indices of sequences whose token rules allow no token).
    `history_width(n)` buckets the penalty history of the longest
    sequence with penalties."""
    S = len(scheduled)
    starts = np.fromiter([sc.start for sc in scheduled], np.int32, S)
    q_lens = np.fromiter([sc.num_rows for sc in scheduled], np.int32, S)
    prev = np.fromiter([sc.prev_row for sc in scheduled], np.int32, S)
    num_output = np.fromiter(
        [sc.seq.num_output_tokens + sc.seq.inflight_tokens for sc in scheduled], np.int32, S
    )
    num_spec = np.zeros(S, np.int32)
    tokens = np.zeros(int(q_lens.sum()), np.int32)
    row = 0
    for i, sc in enumerate(scheduled):
        n, k = sc.num_rows, len(sc.spec_tokens)
        if sc.prev_row < 0:  # else its input is the token sampled in flight, on the device
            ids = sc.seq.all_token_ids
            if n - k == 1:
                tokens[row] = ids[sc.start]
            else:
                tokens[row : row + n - k] = ids[sc.start : sc.start + n - k]
        if k:
            num_spec[i] = k
            tokens[row + n - k : row + n] = sc.spec_tokens
        row += n
    rec = np.frombuffer(b"".join([sc.seq.sampling_row for sc in scheduled]), ROW_DTYPE)
    sampling = SamplingBatch(**{f: rec[f] for f in SAMPLING_FIELDS})
    stops = StopBatch(
        stop_ids=rec["stop_ids"], min_tokens=rec["min_tokens"], max_tokens=rec["max_tokens"]
    )
    W = pages_per_seq
    block_tables = (
        np.stack([sc.seq.progress.pages[:W] for sc in scheduled])
        if S
        else np.zeros((0, W), np.int32)
    )
    rules, stuck = _rules(scheduled, vocab_size)
    plan = StepPlan(
        token_ids=tokens,
        starts=starts,
        q_lens=q_lens,
        num_spec=num_spec,
        prev_index=prev,
        block_tables=block_tables,
        num_output=num_output,
        sampling=sampling,
        stops=stops,
        num_steps=num_steps,
        penalties=_penalties(scheduled, history_width),
        rules=rules,
        ring_base=np.fromiter([sc.seq.ring_base for sc in scheduled], np.int32, S),
        lora_slots=np.fromiter([sc.seq.lora_slot for sc in scheduled], np.int32, S),
    )
    return plan, stuck


def _penalties(scheduled: Seq, history_width) -> PenaltyBatch | None:
    """The token history the penalty sampler reads, or None when no
    sequence of the step uses a penalty."""
    users = [i for i, sc in enumerate(scheduled) if sc.seq.params.uses_penalties]
    if not users:
        return None
    longest = max(scheduled[i].seq.num_tokens for i in users)
    N = history_width(longest) if history_width is not None else longest
    hist = np.full((len(scheduled), N), -1, np.int32)
    is_out = np.zeros((len(scheduled), N), bool)
    for i in users:
        seq = scheduled[i].seq
        hist[i, : seq.num_tokens] = seq.all_token_ids
        is_out[i, seq.num_prompt_tokens : seq.num_tokens] = True
    return PenaltyBatch(history=hist, history_is_output=is_out)


def _rules(scheduled: Seq, vocab_size: int) -> tuple[RulesBatch | None, list[int]]:
    """The token rules of a step, or None when no sequence has any; and the
    sequences whose rules allow no token at all (they cannot go on)."""
    users = [i for i, sc in enumerate(scheduled) if sc.seq.rules is not None]
    if not users:
        return None, []
    S = len(scheduled)
    rb = RulesBatch(
        bitmask=np.full((S, (vocab_size + 31) // 32), -1, np.int32),
        bias_ids=np.full((S, BIAS_WIDTH), -1, np.int32),
        bias_values=np.zeros((S, BIAS_WIDTH), np.float32),
    )
    stuck = []
    for i in users:
        seq = scheduled[i].seq
        if not seq.rules.fill(rb.bitmask, i, seq.output_token_ids):
            stuck.append(i)
        pairs = seq.rules.bias
        if pairs:
            rb.bias_ids[i, : len(pairs)] = [t for t, _ in pairs]
            rb.bias_values[i, : len(pairs)] = [v for _, v in pairs]
    return rb, stuck
