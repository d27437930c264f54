"""Speculative verification in the ragged step.

    verify_step(graphdef, state, cache, batch, rng, last) -> (StepOutput, cache, last)
    (cache and `last` as in `jaxkv.worker.step.step`)

Each sequence of a verify step brings its last token and k_s <= k
proposals x_1..x_k_s (rows cu_q_lens[s] ..); `batch.logits_indices` [S, k
+ 1] (flattened) names its rows from the last token on, the last repeated
past k_s. The target samples every one of those rows with the request's
own sampling options and seed stream (row j is output token num_output +
j), then `num_accepted` keeps the longest prefix of proposals equal to the
target's draws; the draw after that prefix is the target's own token. The
sequence gains the accepted proposals and that token (accepted + 1
tokens); K/V written for rejected rows is overwritten later.

Proposals are deterministic (n-gram lookup, a greedy draft), a point mass
q = 1{x}, for which this is exactly speculative rejection sampling:
accept x with min(1, p(x) / q(x)) = p(x), and on rejection draw from
max(0, p - q) normalized, i.e. p without x: the target's draw y given
y != x. Greedy (temperature 0) is the special case "x equals the argmax".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import KVCache
from jaxkv.worker.sampler import sample
from jaxkv.worker.step import StepOutput, newest, run_model, take_previous
from jaxkv.worker.step_batch import StepBatch


def num_accepted(proposals, num_proposed, draws):
    """proposals [S, k], num_proposed [S], draws [S, k] the target's tokens
    at the rows before each proposal's position -> accepted [S]: the longest
    prefix where the proposal equals the target's draw."""
    k = proposals.shape[1]
    ok = (jnp.arange(k)[None, :] < num_proposed[:, None]) & (proposals == draws)
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def verify_step(
    graphdef,
    state,
    cache: KVCache,
    batch: StepBatch,
    rng,
    last,
    *,
    num_spec: int,
    num_top_logprobs: int,
    attention: AttentionSpec,
):
    out, cache = _verify(
        nnx.merge(graphdef, state),
        cache,
        take_previous(batch, last),
        rng,
        num_spec=num_spec,
        num_top_logprobs=num_top_logprobs,
        attention=attention,
    )
    return dataclasses.replace(out, routed=cache.routed), cache, newest(out, last.shape[0])


def _verify(
    model,
    cache: KVCache,
    batch: StepBatch,
    rng,
    *,
    num_spec: int,
    num_top_logprobs: int,
    attention: AttentionSpec,
):
    logits, cache, feats = run_model(model, cache, batch, attention, False)  # [S (k+1), V]
    S = batch.kv_lens.shape[0]
    T = batch.token_ids.shape[0]
    K1 = num_spec + 1
    rows = lambda x: jnp.repeat(x, K1, axis=0)  # noqa: E731  [S, ...] -> [S (k+1), ...]
    sb = jax.tree_util.tree_map(rows, batch.sampling)
    num_output = rows(batch.num_output) + jnp.tile(jnp.arange(K1, dtype=jnp.int32), S)
    out = sample(logits, sb, rng, num_output, num_top_logprobs=num_top_logprobs)
    idx = batch.logits_indices.reshape(S, K1)
    k_s = idx[:, -1] - idx[:, 0]
    proposals = batch.token_ids[jnp.minimum(idx[:, :-1] + 1, T - 1)]  # [S, k]
    draws = out.token_ids.reshape(S, K1)
    accepted = num_accepted(proposals, k_s, draws[:, :-1])
    # Output j: proposal j while accepted, then the target's own draw.
    taken = jnp.arange(num_spec)[None, :] < accepted[:, None]
    tokens = draws.at[:, :-1].set(jnp.where(taken, proposals, draws[:, :-1]))
    live = jnp.arange(S) < batch.num_seqs
    by_row = lambda x: jnp.swapaxes(x.reshape(S, K1, *x.shape[1:]), 0, 1)  # noqa: E731
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    return StepOutput(
        tokens.T,
        by_row(out.logprob),
        by_row(out.top_ids),
        by_row(out.top_logprobs),
        by_row(finite),
        jnp.int32(K1),
        logits.reshape(S, K1, -1)[:, 0],
        jnp.where(live, accepted + 1, 0).astype(jnp.int32),
        features=feats,
    ), cache
