"""StepBatch: everything the device needs for one step, in fixed shapes, and
`pack`, the one function that builds it from a step's plan
(`jaxkv.worker.plan.StepPlan`).

Every array is int32 unless said otherwise. T tokens and S sequences are
padded up to a bucket (`jaxkv.worker.buckets`); W, the block-table width,
is fixed per engine (the pages of its longest allowed sequence), so a step
compiles once per program key (`ProgramKey`: kind, T, S) and never again:

    token_ids[T]        input token of each row (0 for padding)
    positions[T]        absolute position of each row (RoPE)
    slot_mapping[T]     page * page_size + offset the row's K/V goes to
                        (padding rows point into the trash page 0)
    cu_q_lens[S+1]      rows of sequence s are cu_q_lens[s] : cu_q_lens[s+1]
    kv_lens[S]          tokens in the cache for s after this step's writes
    block_tables[S, W]  pages of s in order (0 past its last page)
    num_seqs[]          live sequences; the rest are padding
    logits_indices[S]   row whose logits are sampled for s (its last row);
                        [S, k + 1] flattened in a verify step: s's rows
                        from its last known token on, repeating the last
    num_output[S]       tokens s generated before this step (seed stream
                        index, stop rules)
    ring_base[S]        hybrid KV pool: the first page of s's ring of
                        sliding-layer pages (0 without one; see
                        `jaxkv.model.attention.local_view`)
    lora_slot[T]        the LoRA slot each row's projections add (0: none,
                        m + 1: slot m; `jaxkv.model.lora`)
    score_from[S]       importance eviction: s's rows at kv index >= this
                        add their attention to the cache's scores
                        (`jaxkv.model.kv_scores`; 2**30: none)
    num_steps[]         decode steps to run (decode programs; 1 otherwise)
    prev_index[T]       -1, or for a row whose input token is not on the host
                        yet (overlapped scheduling): the index of its
                        sequence in the previous step, whose newest sampled
                        token the program takes on the device
    sampling            SamplingBatch: per-sequence sampling parameters
    stops               StopBatch: per-sequence stop rules (`jaxkv.worker.stop`)

A decode is a sequence with one row, a prefill chunk one with several; both
ride in the same step. A "decode" program serves steps where every sequence
brings one row and may run several decode steps in one call (each step's
token is the next one's input); a "mixed" program serves every other step;
a "both" program, a shape that is both, serves either. A "verify"
program serves decode-only steps where some sequences bring proposals
(speculative decoding): its rows are the last token then the proposals.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxkv.worker.buckets import ProgramKey
from jaxkv.worker.stop import STOP_WIDTH, StopBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-sequence sampling parameters [S] (f32 unless said otherwise):
    temperature (0: greedy), top_k i32 (<= 0: off), top_p (1: off), min_p
    (0: off), seeds u32 (the request's seed), num_logprobs i32 (top
    log-probabilities wanted, 0: none), and the penalties (0, 0, 1: off),
    applied by the penalty sampler only (`PenaltyBatch`)."""

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    seeds: Any
    num_logprobs: Any
    presence_penalty: Any
    frequency_penalty: Any
    repetition_penalty: Any


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingBatch))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyBatch:
    """What penalties need beside the logits: history[S, N] the prompt and
    output tokens (-1 padded, N a history bucket), history_is_output[S, N]
    bool. Only built for steps where some sequence uses a penalty."""

    history: Any
    history_is_output: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RulesBatch:
    """Token rules (`jaxkv.core.structured`): bitmask[S, ceil(V / 32)] i32,
    bit v % 32 of word v // 32 set when token v may be sampled (all ones for
    a sequence without rules); bias_ids[S, B] i32 (-1 padded) and
    bias_values[S, B] f32, added to the logits. Only built for steps where
    some sequence has rules."""

    bitmask: Any
    bias_ids: Any
    bias_values: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    token_ids: Any
    positions: Any
    slot_mapping: Any
    cu_q_lens: Any
    kv_lens: Any
    block_tables: Any
    num_seqs: Any
    logits_indices: Any
    num_output: Any
    num_steps: Any
    prev_index: Any
    sampling: SamplingBatch
    stops: StopBatch
    ring_base: Any = None
    lora_slot: Any = None
    score_from: Any = None  # [S] importance eviction: rows at kv index >= this are scored


def empty(key: ProgramKey, pages_per_seq: int, num_spec: int = 0) -> StepBatch:
    """An all-padding StepBatch of `key`'s shape (every row writes to the trash
    page; no live sequence; a verify key's k = `num_spec`). Also the
    template `pack` fills."""
    T, S = key.tokens, key.seqs
    f32 = lambda v: np.full(S, v, np.float32)  # noqa: E731
    i32 = lambda n: np.zeros(n, np.int32)  # noqa: E731
    sampling = SamplingBatch(
        temperature=f32(0.0),
        top_k=i32(S),
        top_p=f32(1.0),
        min_p=f32(0.0),
        seeds=np.zeros(S, np.uint32),
        num_logprobs=i32(S),
        presence_penalty=f32(0.0),
        frequency_penalty=f32(0.0),
        repetition_penalty=f32(1.0),
    )
    stops = StopBatch(
        stop_ids=np.full((S, STOP_WIDTH), -1, np.int32),
        min_tokens=i32(S),
        max_tokens=np.ones(S, np.int32),
    )
    return StepBatch(
        token_ids=i32(T),
        positions=i32(T),
        slot_mapping=i32(T),
        cu_q_lens=i32(S + 1),
        kv_lens=i32(S),
        block_tables=np.zeros((S, pages_per_seq), np.int32),
        num_seqs=np.asarray(0, np.int32),
        logits_indices=i32(S * (num_spec + 1) if key.kind == "verify" else S),
        num_output=i32(S),
        num_steps=np.asarray(1, np.int32),
        prev_index=np.full(T, -1, np.int32),
        sampling=sampling,
        stops=stops,
        ring_base=i32(S),
        lora_slot=i32(T),
        score_from=np.full(S, 1 << 30, np.int32),
    )


def pack(plan, key: ProgramKey, page_size: int, pages_per_seq: int, num_spec: int = 0) -> StepBatch:
    """The one row packer: a `jaxkv.worker.plan.StepPlan` padded to `key`'s
    shape (rows and per-sequence arrays, slots from each row's position
    and block table), all numpy and vectorized. `num_spec` is a verify
    key's k. Raises ValueError naming the sequence whose rows do not fit
    its pages or the key."""
    S, T = plan.num_seqs, plan.num_rows
    q = np.asarray(plan.q_lens, np.int32)
    if S > key.seqs or T > key.tokens:
        raise ValueError(
            f"tokens per step: {T} rows of {S} sequences exceed the program {tuple(key)}"
        )
    if plan.num_steps > 1 and (np.any(q != 1) or np.any(plan.num_spec)):
        raise ValueError("num_steps > 1 needs every sequence to bring exactly one token")
    prev = np.asarray(plan.prev_index, np.int32)
    if np.any((prev >= 0) & ((q != 1) | (plan.num_spec > 0))):
        bad = int(np.flatnonzero((prev >= 0) & ((q != 1) | (plan.num_spec > 0)))[0])
        raise ValueError(f"sequence {bad}: a row resolved on the device comes alone")
    if np.any(plan.num_spec > (num_spec if key.kind == "verify" else 0)):
        bad = int(np.flatnonzero(plan.num_spec > num_spec)[0])
        raise ValueError(
            f"sequence {bad}: {int(plan.num_spec[bad])} proposals, at most "
            f"{num_spec if key.kind == 'verify' else 0}"
        )
    b = empty(key, pages_per_seq, num_spec)
    cu = b.cu_q_lens
    np.cumsum(q, out=cu[1 : S + 1])
    cu[S + 1 :] = T
    seq_of_row = np.repeat(np.arange(S), q)
    pos = plan.starts[seq_of_row] + (np.arange(T) - cu[seq_of_row])
    tables = plan.block_tables
    width = tables.shape[1] if S else 0
    page_idx = pos // page_size
    over = page_idx >= min(width, pages_per_seq)
    pages = tables[seq_of_row, np.minimum(page_idx, max(width - 1, 0))] if S else page_idx
    if np.any(over | (pages == 0)):
        bad = int(seq_of_row[np.flatnonzero(over | (pages == 0))[0]])
        end = int(plan.starts[bad] + q[bad])
        held = int(np.count_nonzero(tables[bad])) if S else 0
        raise ValueError(
            f"sequence {bad}: {end} positions but {held} pages (at most {pages_per_seq})"
        )
    b.token_ids[:T] = plan.token_ids
    # Positions (RoPE) run on past kv indices by the tokens eviction dropped.
    b.positions[:T] = pos if plan.pos_offset is None else pos + plan.pos_offset[seq_of_row]
    if plan.score_from is not None:
        b.score_from[:S] = plan.score_from
    b.slot_mapping[:T] = pages * page_size + pos % page_size
    b.kv_lens[:S] = plan.starts + q
    b.block_tables[:S, :width] = tables[:, :pages_per_seq]
    last = cu[1 : S + 1] - 1
    if key.kind == "verify":
        K1 = num_spec + 1
        k = np.asarray(plan.num_spec, np.int32)
        idx = (last - k)[:, None] + np.minimum(np.arange(K1)[None, :], k[:, None])
        b.logits_indices[: S * K1] = idx.reshape(-1)
    else:
        b.logits_indices[:S] = last
    has_prev = prev >= 0
    b.prev_index[cu[:S][has_prev]] = prev[has_prev]
    b.num_output[:S] = plan.num_output
    if plan.ring_base is not None:
        b.ring_base[:S] = plan.ring_base
    if plan.lora_slots is not None:
        b.lora_slot[:T] = plan.lora_slots[seq_of_row]
    for name in SAMPLING_FIELDS:
        getattr(b.sampling, name)[:S] = getattr(plan.sampling, name)
    for name in ("stop_ids", "min_tokens", "max_tokens"):
        getattr(b.stops, name)[:S] = getattr(plan.stops, name)
    return dataclasses.replace(
        b, num_seqs=np.asarray(S, np.int32), num_steps=np.asarray(plan.num_steps, np.int32)
    )


def pad_penalties(pen: PenaltyBatch, rows: int) -> PenaltyBatch:
    """A step's penalty history [S, N] padded to `rows` sequences."""
    S, N = pen.history.shape
    hist = np.full((rows, N), -1, np.int32)
    is_out = np.zeros((rows, N), bool)
    hist[:S], is_out[:S] = pen.history, pen.history_is_output
    return PenaltyBatch(history=hist, history_is_output=is_out)


BIAS_WIDTH = 300  # SamplingParams.MAX_LOGIT_BIAS


def empty_rules(num_seqs: int, vocab_size: int) -> RulesBatch:
    """All tokens allowed, no bias, for `num_seqs` sequences."""
    return RulesBatch(
        bitmask=np.full((num_seqs, (vocab_size + 31) // 32), -1, np.int32),
        bias_ids=np.full((num_seqs, BIAS_WIDTH), -1, np.int32),
        bias_values=np.zeros((num_seqs, BIAS_WIDTH), np.float32),
    )


def pad_rules(rules: RulesBatch, rows: int, vocab_size: int) -> RulesBatch:
    """A step's token rules [S, ...] padded to `rows` sequences (all
    allowed)."""
    out = empty_rules(rows, vocab_size)
    S = rules.bitmask.shape[0]
    out.bitmask[:S], out.bias_ids[:S], out.bias_values[:S] = (
        rules.bitmask,
        rules.bias_ids,
        rules.bias_values,
    )
    return out
