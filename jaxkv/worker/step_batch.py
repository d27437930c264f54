"""StepBatch: everything the device needs for one step, in fixed shapes, and
the one function that builds it from the scheduler's output.

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
from typing import Any, Sequence

import jax
import numpy as np

from jaxkv.worker.buckets import Buckets, ProgramKey
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


def empty(key: ProgramKey, pages_per_seq: int, num_spec: int = 0) -> StepBatch:
    """An all-padding StepBatch of `key`'s shape (every row writes to the trash
    page; no live sequence; a verify key's k = `num_spec`). Also the
    template `build_step_batch` fills."""
    T, S = key.tokens, key.seqs
    f32 = lambda v: np.full(S, v, np.float32)  # noqa: E731
    i32 = lambda n: np.zeros(n, np.int32)  # noqa: E731
    sampling = SamplingBatch(temperature=f32(0.0), top_k=i32(S), top_p=f32(1.0), min_p=f32(0.0),
                             seeds=np.zeros(S, np.uint32), num_logprobs=i32(S),
                             presence_penalty=f32(0.0), frequency_penalty=f32(0.0),
                             repetition_penalty=f32(1.0))
    stops = StopBatch(stop_ids=np.full((S, STOP_WIDTH), -1, np.int32), min_tokens=i32(S),
                      max_tokens=np.ones(S, np.int32))
    return StepBatch(token_ids=i32(T), positions=i32(T), slot_mapping=i32(T),
                     cu_q_lens=i32(S + 1), kv_lens=i32(S),
                     block_tables=np.zeros((S, pages_per_seq), np.int32),
                     num_seqs=np.asarray(0, np.int32),
                     logits_indices=i32(S * (num_spec + 1) if key.kind == "verify" else S),
                     num_output=i32(S), num_steps=np.asarray(1, np.int32),
                     prev_index=np.full(T, -1, np.int32), sampling=sampling, stops=stops)


def build_step_batch(scheduled: Sequence[Any], num_steps: int, page_size: int,
                     buckets: Buckets) -> tuple[StepBatch, ProgramKey]:
    """Pack the scheduler's output into a padded StepBatch and pick its program.

    `scheduled[i]` has `seq` (with `all_token_ids`, `output_token_ids`,
    `params` (SamplingParams), `seed` and `stop` (StopRule)), `start` (first
    position computed), `num_tokens` (rows) and `block_table` (its pages,
    reserved for every position this call writes). With `num_steps` > 1
    every sequence brings one row and its block table already covers the
    positions of the tokens it may still generate, up to num_steps. A
    sequence with `spec_tokens` (k proposals) brings them after its last
    known token (num_tokens counts them): the step is a verify step. A
    sequence with `prev_row` >= 0 (overlapped scheduling) brings one row
    whose token the previous step samples (index `prev_row` there) and
    has `seq.ahead` tokens on their way to the host. This is the only place
    SamplingParams fields are copied into arrays."""
    n_tok = sum(sc.num_tokens for sc in scheduled)
    spec = [len(getattr(sc, "spec_tokens", ()) or ()) for sc in scheduled]
    decode = all(sc.num_tokens == 1 for sc in scheduled)
    if num_steps > 1 and not decode:
        raise ValueError("num_steps > 1 needs every sequence to bring exactly one token")
    if any(spec) and num_steps > 1:
        raise ValueError("a verify step runs one step")
    key = (buckets.verify_key(n_tok, len(scheduled)) if any(spec)
           else buckets.decode_key(len(scheduled)) if decode
           else buckets.mixed_key(n_tok, len(scheduled)))
    K1 = buckets.num_spec + 1
    W = buckets.pages_per_seq
    b = empty(key, W, buckets.num_spec)
    sp, st = b.sampling, b.stops
    row = 0
    for i, sc in enumerate(scheduled):
        seq, n = sc.seq, sc.num_tokens
        end = sc.start + n
        table = np.asarray(sc.block_table, np.int32)
        if len(table) > W or len(table) * page_size < end:
            raise ValueError(f"sequence {i}: {end} positions but {len(table)} pages "
                             f"(at most {W})")
        pos = np.arange(sc.start, end)
        k = spec[i]
        prev = sc.prev_row
        if prev >= 0:
            if n != 1 or k:
                raise ValueError(f"sequence {i}: a row resolved on the device comes alone")
            b.prev_index[row] = prev
        else:
            b.token_ids[row:row + n - k] = seq.all_token_ids[sc.start:end - k]
        if k:
            if k > buckets.num_spec:
                raise ValueError(f"sequence {i}: {k} proposals, at most {buckets.num_spec}")
            b.token_ids[row + n - k:row + n] = sc.spec_tokens
        b.positions[row:row + n] = pos
        b.slot_mapping[row:row + n] = table[pos // page_size] * page_size + pos % page_size
        b.block_tables[i, :len(table)] = table
        b.kv_lens[i] = end
        row += n
        b.cu_q_lens[i + 1] = row
        if key.kind == "verify":
            b.logits_indices[i * K1:(i + 1) * K1] = row - 1 - k + np.minimum(np.arange(K1), k)
        else:
            b.logits_indices[i] = row - 1
        b.num_output[i] = len(seq.output_token_ids) + seq.ahead
        p = seq.params
        sp.temperature[i], sp.top_k[i], sp.top_p[i], sp.min_p[i] = (
            p.temperature, min(p.top_k, np.iinfo(np.int32).max), p.top_p, p.min_p)
        sp.seeds[i] = seq.seed & 0xFFFFFFFF
        sp.num_logprobs[i] = p.logprobs or 0
        sp.presence_penalty[i], sp.frequency_penalty[i], sp.repetition_penalty[i] = (
            p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        seq.stop.fill(st, i)
    b.cu_q_lens[len(scheduled) + 1:] = row
    b = dataclasses.replace(b, num_seqs=np.asarray(len(scheduled), np.int32),
                            num_steps=np.asarray(num_steps, np.int32))
    return b, key


def build_penalty_batch(scheduled: Sequence[Any], num_seqs: int,
                        buckets: Buckets) -> PenaltyBatch | None:
    """The history the penalty sampler reads, or None when no sequence of
    the step uses a penalty."""
    users = [i for i, sc in enumerate(scheduled) if sc.seq.params.uses_penalties]
    if not users:
        return None
    N = buckets.history_width(max(scheduled[i].seq.num_tokens for i in users))
    hist = np.full((num_seqs, N), -1, np.int32)
    is_out = np.zeros((num_seqs, N), bool)
    for i in users:
        seq = scheduled[i].seq
        toks = seq.all_token_ids
        hist[i, :len(toks)] = toks
        is_out[i, len(seq.prompt_token_ids):len(toks)] = True
    return PenaltyBatch(history=hist, history_is_output=is_out)


BIAS_WIDTH = 300  # SamplingParams.MAX_LOGIT_BIAS


def empty_rules(num_seqs: int, vocab_size: int) -> RulesBatch:
    return RulesBatch(bitmask=np.full((num_seqs, (vocab_size + 31) // 32), -1, np.int32),
                      bias_ids=np.full((num_seqs, BIAS_WIDTH), -1, np.int32),
                      bias_values=np.zeros((num_seqs, BIAS_WIDTH), np.float32))


def build_rules_batch(scheduled: Sequence[Any], num_seqs: int,
                      vocab_size: int) -> tuple[RulesBatch | None, list[int]]:
    """The token rules of a step, or None when no sequence has any; and the
    rows whose rules allow no token at all (those sequences cannot go on)."""
    users = [i for i, sc in enumerate(scheduled) if sc.seq.rules is not None]
    if not users:
        return None, []
    rb = empty_rules(num_seqs, vocab_size)
    stuck = []
    for i in users:
        seq = scheduled[i].seq
        if not seq.rules.fill(rb.bitmask, i, seq.output_token_ids):
            stuck.append(i)
        pairs = seq.rules.bias
        if pairs:
            rb.bias_ids[i, :len(pairs)] = [t for t, _ in pairs]
            rb.bias_values[i, :len(pairs)] = [v for _, v in pairs]
    return rb, stuck
