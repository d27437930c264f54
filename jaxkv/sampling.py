"""The in-jit sampler: greedy, temperature, top-k, top-p, min-p and
presence / frequency / repetition penalties, per sequence, with reproducible
per-request seeds and log-probabilities.

Per-sequence arrays (SamplingBatch, S sequences):
    temperature[S] f32  0 means greedy (argmax)
    top_k[S] i32        <= 0 means off
    top_p[S] f32        1 means off
    min_p[S] f32        0 means off
    seeds[S] u32        the request's seed; with sample_index it fixes the draw
    sample_index[S] i32 how many tokens the request has sampled before
    presence_penalty[S], frequency_penalty[S], repetition_penalty[S] f32
    history[S, N] i32   prompt and output tokens for the penalties, -1 padded
                        (N = 0 when no sequence in the batch uses a penalty)
    history_is_output[S, N] bool

The draw for a request's n-th token uses key fold_in(fold_in(rng, seed), n)
where rng is the engine's base key, so a seeded request gives the same tokens
however it is batched or preempted.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    seeds: jax.Array
    sample_index: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repetition_penalty: jax.Array
    history: jax.Array
    history_is_output: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """token_ids[S]; logprob[S] f32 of the chosen token under the model's raw
    distribution; top_ids / top_logprobs [S, N] the N most likely tokens."""

    token_ids: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def apply_penalties(logits, sb: SamplingBatch):
    """Penalties like vLLM's: repetition divides positive / multiplies negative
    logits of tokens seen in prompt or output; presence and frequency subtract
    per occurrence in the output. logits [S, V] f32."""
    S, V = logits.shape
    if sb.history.shape[1] == 0:
        return logits
    hist = sb.history
    valid = hist >= 0
    idx = jnp.where(valid, hist, 0)
    rows = jnp.arange(S)[:, None]
    seen = jnp.zeros((S, V), bool).at[rows, idx].max(valid)
    out_counts = jnp.zeros((S, V), jnp.float32).at[rows, idx].add(
        (valid & sb.history_is_output).astype(jnp.float32))
    rp = sb.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - sb.frequency_penalty[:, None] * out_counts
    logits = logits - sb.presence_penalty[:, None] * (out_counts > 0)
    return logits


def sample(logits, sb: SamplingBatch, rng, *, num_top_logprobs: int = 0,
           all_greedy: bool = False) -> SampleOutput:
    """logits [S, V] -> SampleOutput. `all_greedy` (static) skips the sort and
    the draw when every sequence is greedy; `num_top_logprobs` (static) is N."""
    logits = logits.astype(jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = apply_penalties(logits, sb)
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if all_greedy:
        ids = greedy_ids
    else:
        ids = jnp.where(sb.temperature <= 0, greedy_ids, _draw(logits, sb, rng))
    chosen = jnp.take_along_axis(raw_logprobs, ids[:, None], axis=-1)[:, 0]
    if num_top_logprobs:
        top_lp, top_ids = jax.lax.top_k(raw_logprobs, num_top_logprobs)
    else:
        S = logits.shape[0]
        top_lp = jnp.zeros((S, 0), jnp.float32)
        top_ids = jnp.zeros((S, 0), jnp.int32)
    return SampleOutput(token_ids=ids, logprob=chosen, top_ids=top_ids.astype(jnp.int32),
                        top_logprobs=top_lp)


def _draw(logits, sb: SamplingBatch, rng):
    """Filtered random draw: temperature, then top-k, top-p, min-p over the
    sorted distribution, then Gumbel-max with the per-request key."""
    S, V = logits.shape
    t = jnp.where(sb.temperature > 0, sb.temperature, 1.0)[:, None]
    scaled = logits / t
    sorted_logits, sorted_ids = jax.lax.top_k(scaled, V)  # descending [S, V]
    rank = jnp.arange(V)[None, :]
    k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, V), V)[:, None]
    keep = rank < k
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first
    # token always stays).
    before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (before < sb.top_p[:, None]) | (rank == 0)
    keep &= probs >= sb.min_p[:, None] * probs[:, :1]
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    def gumbel(seed, n):
        key = jax.random.fold_in(jax.random.fold_in(rng, seed), n)
        return jax.random.gumbel(key, (V,), jnp.float32)

    g = jax.vmap(gumbel)(sb.seeds, sb.sample_index)
    choice = jnp.argmax(masked + g, axis=-1)
    return jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
