"""Logits at every row of a few sequences, in one ragged prefill: for
log-likelihoods and teacher-forced checks (quality scripts, model tests),
outside the engine's step programs.

    logits = prefill_logits(model, [(token_ids, start, block_table), ...], cache)

Each entry writes its tokens at positions start, start + 1, ... into the
pages of its block table (the cache is donated and returned) and gets the
logits of each of its rows, [len(token_ids), V], or of its last row only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import KVCache, create_cache, preset_fp8_scales
from jaxkv.worker.buckets import ProgramKey
from jaxkv.worker.plan import StepPlan
from jaxkv.worker.step_batch import StepBatch, empty, pack


def plan_for(
    seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]], num_steps: int = 1
) -> StepPlan:
    """A greedy StepPlan of `seqs` (token ids, first position, block
    table), no stop rules: for direct model calls and tests."""
    S = len(seqs)
    W = max((len(b) for _, _, b in seqs), default=1)
    tables = np.zeros((S, W), np.int32)
    for i, (_, _, b) in enumerate(seqs):
        tables[i, : len(b)] = b
    tmpl = empty(ProgramKey("mixed", 1, S), W)
    return StepPlan(
        token_ids=np.concatenate([np.asarray(t, np.int32) for t, _, _ in seqs])
        if seqs
        else np.zeros(0, np.int32),
        starts=np.array([s for _, s, _ in seqs], np.int32),
        q_lens=np.array([len(t) for t, _, _ in seqs], np.int32),
        num_spec=np.zeros(S, np.int32),
        prev_index=np.full(S, -1, np.int32),
        block_tables=tables,
        num_output=np.zeros(S, np.int32),
        sampling=tmpl.sampling,
        stops=tmpl.stops,
        num_steps=num_steps,
    )


def scoring_batch(
    seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]], page_size: int, rows_per_seq: bool
) -> StepBatch:
    """A StepBatch of `seqs` (token ids, first position, block table) with no
    padding; with `rows_per_seq`, logits_indices holds every row (T of
    them, beside the S sequences)."""
    plan = plan_for(seqs)
    T = plan.num_rows
    W = plan.block_tables.shape[1]
    b = pack(plan, ProgramKey("mixed", T, len(seqs)), page_size, W)
    if rows_per_seq:
        b = dataclasses.replace(b, logits_indices=np.arange(T, dtype=np.int32))
    return b


@functools.lru_cache(maxsize=8)
def _run(graphdef, attention):
    return jax.jit(lambda state, c, b: nnx.merge(graphdef, state)(c, b, attention))


def prefill_logits(
    model,
    seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]],
    cache: KVCache,
    *,
    rows_per_seq: bool = True,
    attention: AttentionSpec | None = None,
):
    """-> (list of float32 numpy logits per sequence: [len, V] with
    `rows_per_seq`, else [V] of the last row; the updated cache). The
    attention is the model's own (its sliding window) unless given."""
    attention = attention or AttentionSpec(sliding_window=model.config.uniform_window)
    batch = scoring_batch(seqs, cache.page_size, rows_per_seq)
    graphdef, state = nnx.split(model)
    # the weights are an argument: closed over, they would be constants of
    # the program (slow to compile, and hundreds of MB in JAX's cache)
    logits, cache = _run(graphdef, attention)(state, cache, batch)
    logits = np.asarray(logits)
    if not rows_per_seq:
        return [logits[i] for i in range(len(seqs))], cache
    cu = batch.cu_q_lens
    return [logits[cu[i] : cu[i + 1]] for i in range(len(seqs))], cache


def sequence_logits(
    model, token_lists: Sequence[Sequence[int]], *, page_size: int = 16, kv_dtype: str = "float32"
) -> list[np.ndarray]:
    """Logits [len, V] at every position of each token list, through a
    fresh paged cache of `kv_dtype` (pages laid out one list after another)."""
    from jaxkv.config import CacheConfig

    seqs, first = [], 1
    for toks in token_lists:
        pages = -(-len(toks) // page_size)
        seqs.append((list(toks), 0, list(range(first, first + pages))))
        first += pages
    cache = preset_fp8_scales(
        create_cache(
            model.config, CacheConfig(num_pages=first + 1, page_size=page_size, kv_dtype=kv_dtype)
        ),
        model.kv_cache_scales(),
    )
    logits, _ = prefill_logits(model, seqs, cache)
    return logits
