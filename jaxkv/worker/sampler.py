"""The in-jit sampler: greedy, temperature, top-k, top-p, min-p, with
reproducible per-request seeds and log-probabilities, and a second entry
that first applies token rules (mask, bias) and presence / frequency /
repetition penalties.

    sample(logits [S, V], SamplingBatch, rng, num_output [S]) -> SampleOutput
    sample_with_rules(logits, SamplingBatch, PenaltyBatch | None, RulesBatch, rng, num_output)

The draw for a request's n-th token uses key fold_in(fold_in(rng, seed), n)
where rng is the engine's base key and n = num_output, so a seeded request
gives the same tokens however it is batched or preempted. Whether any row
samples (not greedy) and whether any row wants top log-probabilities are
decided at run time (`lax.cond`), so one program serves every mix. Steps
with token rules or penalties draw again from the step's last logits with
`sample_with_rules` (rules first, then penalties).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.worker.step_batch import PenaltyBatch, RulesBatch, SamplingBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """token_ids[S]; logprob[S] f32 of the chosen token under the model's raw
    distribution; top_ids / top_logprobs [S, N] the N most likely tokens
    (zeros when no row asked for them)."""

    token_ids: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def argmax(x):
    """jnp.argmax over the last axis (the first of equal maxima) as two
    plain reductions, a max and a min over the matching ids: XLA's CPU
    backend runs argmax's paired-value reduce 5x slower (a [64, 49152]
    batch of logits 7.1 against 1.5 ms, ~5% of a batch-64 decode step of
    SmolLM2). A row with a NaN gets an id in range but not numpy's first
    NaN: the engine fails such a row whatever its token (StepOutput.finite).
    XLA's CPU max does not always carry a NaN through (a [6, 1000] batch on
    an AMD EPYC gave -inf for a row ending in NaN), so the id is clamped."""
    m = jnp.max(x, axis=-1, keepdims=True)
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where((x == m) | jnp.isnan(m), ids, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)


def apply_penalties(logits, sb: SamplingBatch, pen: PenaltyBatch):
    """Penalties like vLLM's: repetition divides positive / multiplies negative
    logits of tokens seen in prompt or output; presence and frequency subtract
    per occurrence in the output. logits [S, V] f32."""
    S, V = logits.shape
    hist = pen.history
    valid = hist >= 0
    idx = jnp.where(valid, hist, 0)
    rows = jnp.arange(S)[:, None]
    seen = jnp.zeros((S, V), bool).at[rows, idx].max(valid)
    out_counts = (
        jnp.zeros((S, V), jnp.float32)
        .at[rows, idx]
        .add((valid & pen.history_is_output).astype(jnp.float32))
    )
    rp = sb.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - sb.frequency_penalty[:, None] * out_counts
    logits = logits - sb.presence_penalty[:, None] * (out_counts > 0)
    return logits


def sample(
    logits, sb: SamplingBatch, rng, num_output, *, num_top_logprobs: int, raw_logits=None
) -> SampleOutput:
    """logits [S, V] -> SampleOutput with N = `num_top_logprobs` (static)
    columns of top log-probabilities. `raw_logits` (default: `logits`) is
    the distribution log-probabilities are reported under."""
    logits = logits.astype(jnp.float32)
    raw = logits if raw_logits is None else raw_logits.astype(jnp.float32)
    # log-probabilities as raw - logsumexp(raw), formed only where read
    lse = jax.nn.logsumexp(raw, axis=-1)
    greedy_ids = argmax(logits)
    ids = jax.lax.cond(
        jnp.all(sb.temperature <= 0),
        lambda: greedy_ids,
        lambda: jnp.where(sb.temperature <= 0, greedy_ids, _draw(logits, sb, rng, num_output)),
    )
    chosen = jnp.take_along_axis(raw, ids[:, None], axis=-1)[:, 0] - lse
    S, N = logits.shape[0], num_top_logprobs

    def top():
        lp, tid = jax.lax.top_k(raw, N)
        return lp - lse[:, None], tid.astype(jnp.int32)

    def none():
        return jnp.zeros((S, N), jnp.float32), jnp.zeros((S, N), jnp.int32)

    top_lp, top_ids = jax.lax.cond(jnp.any(sb.num_logprobs > 0), top, none) if N else none()
    return SampleOutput(token_ids=ids, logprob=chosen, top_ids=top_ids, top_logprobs=top_lp)


def apply_rules(logits, rules: RulesBatch):
    """Tokens whose bit is clear get -inf, then the bias pairs are added.
    logits [S, V] f32."""
    S, V = logits.shape
    v = jnp.arange(V)
    words = jax.lax.bitcast_convert_type(rules.bitmask, jnp.uint32)[:, v // 32]
    allowed = ((words >> (v % 32).astype(jnp.uint32)) & 1).astype(bool)
    logits = jnp.where(allowed, logits, -jnp.inf)
    valid = rules.bias_ids >= 0
    rows = jnp.arange(S)[:, None]
    return logits.at[rows, jnp.where(valid, rules.bias_ids, 0)].add(
        jnp.where(valid, rules.bias_values, 0.0)
    )


def sample_with_rules(
    logits,
    sb: SamplingBatch,
    pen: PenaltyBatch | None,
    rules: RulesBatch,
    rng,
    num_output,
    *,
    num_top_logprobs: int,
) -> SampleOutput:
    """`sample` after the token rules (mask and bias, first) and the
    penalties when given; log-probabilities stay the model's own."""
    ruled = apply_rules(logits.astype(jnp.float32), rules)
    if pen is not None:
        ruled = apply_penalties(ruled, sb, pen)
    return sample(ruled, sb, rng, num_output, num_top_logprobs=num_top_logprobs, raw_logits=logits)


def _draw(logits, sb: SamplingBatch, rng, num_output):
    """Random draw: temperature, then top-k, top-p, min-p over the sorted
    distribution, then Gumbel-max with the per-request key. The noise is
    drawn per token id, so a row without top-k / top-p / min-p gets the
    same token whether or not its batch needs the sort (steps where no row
    filters skip it)."""
    S, V = logits.shape
    t = jnp.where(sb.temperature > 0, sb.temperature, 1.0)[:, None]
    scaled = logits / t

    def gumbel(seed, n):
        key = jax.random.fold_in(jax.random.fold_in(rng, seed), n)
        return jax.random.gumbel(key, (V,), jnp.float32)

    g = jax.vmap(gumbel)(sb.seeds, num_output)  # [S, V], by token id

    def filtered():
        sorted_logits, sorted_ids = jax.lax.top_k(scaled, V)  # descending [S, V]
        rank = jnp.arange(V)[None, :]
        k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, V), V)[:, None]
        keep = rank < k
        probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
        # top-p: keep the smallest prefix whose mass reaches top_p (the first
        # token always stays; top_p 1 keeps all, whatever the rounding).
        before = jnp.cumsum(probs, axis=-1) - probs
        top_p = sb.top_p[:, None]
        keep &= (before < top_p) | (rank == 0) | (top_p >= 1)
        keep &= probs >= sb.min_p[:, None] * probs[:, :1]
        noise = jnp.take_along_axis(g, sorted_ids, axis=-1)
        choice = argmax(jnp.where(keep, sorted_logits, -jnp.inf) + noise)
        return jnp.take_along_axis(sorted_ids, choice[:, None], axis=-1)[:, 0]

    def plain():
        return argmax(scaled + g)

    needs_sort = jnp.any(((sb.top_k > 0) & (sb.top_k < V)) | (sb.top_p < 1) | (sb.min_p > 0))
    return jax.lax.cond(needs_sort, filtered, plain).astype(jnp.int32)
