"""The jitted step programs.

    step(graphdef, state, cache, batch, rng, last) -> (StepOutput, cache, last)   cache donated
    score_step(graphdef, state, cache, batch, rng, targets) -> (ScoreOutput, cache)
    forward_step(graphdef, state, cache, batch) -> cache    K/V writes only (a draft's mirror)

One function serves every kind of step (`jaxkv.worker.step_batch`): a
mixed step runs the model once and samples one token per sequence; a
decode (or "both") step runs up to `max_steps` (static) model calls in a
`lax.while_loop`, `batch.num_steps` of them (dynamic), each call's sampled
token the next one's input, and ends early once every live sequence hit
its stop rule (`jaxkv.worker.stop.check`). Either way the outputs are
[K, S] with K = 1 or max_steps, and the last call's logits [S, V] stay on
the device for the penalty sampler.

`last` [R] (R the most sequences any step holds) carries each sequence's
newest sampled token from one step program to the next on the device:
a row whose input token the host has not read yet (overlapped
scheduling, `batch.prev_index`) takes it from there (`take_previous`),
and the step writes its own newest tokens back (`newest`).

The NNX model is split once (`nnx.split`, by the Runner) and merged inside
the jitted function; no state crosses calls except the donated cache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import KVCache
from jaxkv.worker import stop as stop_rules
from jaxkv.worker.sampler import SampleOutput, sample
from jaxkv.worker.step_batch import StepBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    """tokens / logprobs [K, S]; top_ids / top_logprobs [K, S, N]; finite
    [K, S] bool (every logit of that row was finite: NaN or inf weights or
    activations show here instead of as a silent token 0); steps[] the model
    calls run (rows past it are zeros); logits [S, V] f32 of the last call;
    counts [S] the rows of each sequence that are its tokens (steps, or in
    a verify step its accepted proposals plus one); routed [X] the cache's
    wrapping routed counts after the step (a mixture of experts; else None);
    features the model's `aux_layers` inputs at every row (an EAGLE-3
    head's; else None): [T, n E], or of a decode loop [K, T, n E], call by
    call."""

    tokens: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    finite: jax.Array
    steps: jax.Array
    logits: jax.Array
    counts: jax.Array
    routed: jax.Array | None = None
    features: jax.Array | None = None


def run_model(model, cache: KVCache, batch, attention: AttentionSpec, all_decode):
    """(logits, cache, features): the model's `aux_layers` inputs when it
    has any (an EAGLE-3 head reads them), else None."""
    if model.aux_layers:
        return model(cache, batch, attention, all_decode=all_decode, features=True)
    return (*model(cache, batch, attention, all_decode=all_decode), None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoreOutput:
    """A prompt chunk's log-probabilities: target_logprobs [T] of each row's
    next prompt token (`targets`), top_ids / top_logprobs [T, N]; and the
    sample of the chunk's last row as a mixed step's would be (tokens,
    logprobs [1, 1], top_ids / top_logprobs [1, 1, N], finite [1, 1],
    logits [1, V])."""

    target_logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    step: StepOutput


def score_step(
    graphdef,
    state,
    cache: KVCache,
    batch: StepBatch,
    rng,
    targets,
    *,
    num_top_logprobs: int,
    attention: AttentionSpec,
):
    """One sequence's prompt chunk with logits at every row (batch.logits_
    indices lists the T rows; sequence 0 is the only live one)."""
    model = nnx.merge(graphdef, state)
    logits, cache = model(cache, batch, attention, all_decode=False)  # [T, V]
    lp = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(lp, num_top_logprobs)
    last = jax.lax.dynamic_slice_in_dim(logits, batch.cu_q_lens[1] - 1, 1)  # [1, V]
    sb = jax.tree_util.tree_map(lambda x: x[:1], batch.sampling)
    out = sample(last, sb, rng, batch.num_output[:1], num_top_logprobs=num_top_logprobs)
    t, lp1, ti, tl = (x[None] for x in _stack(out))
    finite = jnp.all(jnp.isfinite(last), axis=-1)[None]
    return ScoreOutput(
        target,
        top_ids.astype(jnp.int32),
        top_lp,
        StepOutput(t, lp1, ti, tl, finite, jnp.int32(1), last, jnp.ones(1, jnp.int32)),
    ), cache


def forward_step(
    graphdef, state, cache: KVCache, batch: StepBatch, *, kind: str, attention: AttentionSpec
):
    """Run the model over the batch for its K/V writes alone (a draft model
    keeping its cache in step with the target's); the logits are dropped."""
    model = nnx.merge(graphdef, state)
    all_decode = {"decode": True, "both": None}.get(kind, False)
    _, cache = model(cache, batch, attention, all_decode=all_decode)
    return cache


def take_previous(batch: StepBatch, last) -> StepBatch:
    """Rows with prev_index >= 0 take their input token from `last` [R],
    the previous step's newest sampled tokens by its sequence index."""
    prev = batch.prev_index
    tok = jnp.where(prev >= 0, last[jnp.maximum(prev, 0)], batch.token_ids)
    return dataclasses.replace(batch, token_ids=tok)


def newest(out: StepOutput, width: int):
    """Each sequence's newest sampled token (row counts - 1 of tokens
    [K, S]), padded to [width]."""
    S = out.tokens.shape[1]
    row = jnp.clip(out.counts - 1, 0, out.tokens.shape[0] - 1)
    t = jnp.take_along_axis(out.tokens, row[None, :], axis=0)[0]
    return jnp.zeros(width, jnp.int32).at[:S].set(t)


def _stack(outs: SampleOutput):
    return outs.token_ids, outs.logprob, outs.top_ids, outs.top_logprobs


def step(
    graphdef,
    state,
    cache: KVCache,
    batch: StepBatch,
    rng,
    last,
    *,
    kind: str,
    max_steps: int,
    num_top_logprobs: int,
    attention: AttentionSpec,
):
    out, cache = _step(
        nnx.merge(graphdef, state),
        cache,
        take_previous(batch, last),
        rng,
        kind=kind,
        max_steps=max_steps,
        num_top_logprobs=num_top_logprobs,
        attention=attention,
    )
    return dataclasses.replace(out, routed=cache.routed), cache, newest(out, last.shape[0])


def _step(
    model,
    cache: KVCache,
    batch: StepBatch,
    rng,
    *,
    kind: str,
    max_steps: int,
    num_top_logprobs: int,
    attention: AttentionSpec,
):
    if kind == "mixed":  # one step, some rows are prefill chunks
        logits, cache, feats = run_model(model, cache, batch, attention, False)
        out = sample(
            logits, batch.sampling, rng, batch.num_output, num_top_logprobs=num_top_logprobs
        )
        t, lp, ti, tl = (x[None] for x in _stack(out))
        finite = jnp.all(jnp.isfinite(logits), axis=-1)[None]
        S = batch.kv_lens.shape[0]
        return StepOutput(
            t, lp, ti, tl, finite, jnp.int32(1), logits, jnp.ones(S, jnp.int32), features=feats
        ), cache
    # "decode": every row a decode; "both": decided at run time (a mixed
    # batch runs with num_steps 1, its rows need not be its sequences).
    return _decode_loop(
        model,
        cache,
        batch,
        rng,
        max_steps=max_steps,
        num_top_logprobs=num_top_logprobs,
        attention=attention,
        all_decode=True if kind == "decode" else None,
    )


def _decode_loop(
    model,
    cache: KVCache,
    batch: StepBatch,
    rng,
    *,
    max_steps: int,
    num_top_logprobs: int,
    attention: AttentionSpec,
    all_decode: bool | None,
):
    S = batch.kv_lens.shape[0]
    V = model.config.vocab_size
    N = num_top_logprobs
    page_size = cache.page_size
    live = jnp.arange(S) < batch.num_seqs
    st = batch.stops
    bufs = (
        jnp.zeros((max_steps, S), jnp.int32),
        jnp.zeros((max_steps, S), jnp.float32),
        jnp.zeros((max_steps, S, N), jnp.int32),
        jnp.zeros((max_steps, S, N), jnp.float32),
        jnp.ones((max_steps, S), bool),
    )
    num_steps = jnp.minimum(batch.num_steps, max_steps)

    def cond(carry):
        i, _, _, done, _, _, _ = carry
        return (i < num_steps) & ~jnp.all(done)

    def body(carry):
        i, cache, b, done, bufs, _, feats = carry
        logits, cache, f = run_model(model, cache, b, attention, all_decode)
        if f is not None:  # each call's rows: an EAGLE-3 head follows them all
            feats = feats.at[i].set(f)
        out = sample(logits, b.sampling, rng, b.num_output, num_top_logprobs=N)
        row = _stack(out) + (jnp.all(jnp.isfinite(logits), axis=-1),)
        bufs = tuple(buf.at[i].set(x) for buf, x in zip(bufs, row))
        t = out.token_ids
        stopped, length = stop_rules.check(
            jnp, t, b.num_output + 1, st.stop_ids, st.min_tokens, st.max_tokens
        )
        done = done | stopped | length
        pos = b.positions + 1
        page = jnp.take_along_axis(b.block_tables, (pos // page_size)[:, None], axis=1)[:, 0]
        # A finished sequence writes nothing more (its reserved pages end).
        slot = jnp.where(live & ~done, page * page_size + pos % page_size, 0)
        b = dataclasses.replace(
            b,
            token_ids=t,
            positions=pos,
            slot_mapping=slot,
            kv_lens=jnp.where(live, b.kv_lens + 1, 0),
            num_output=b.num_output + 1,
        )
        return i + 1, cache, b, done, bufs, logits, feats

    T = batch.token_ids.shape[0]
    feats = (
        jnp.zeros(
            (max_steps, T, len(model.aux_layers) * model.config.hidden_size),
            model.final_norm[...].dtype,
        )
        if model.aux_layers
        else None
    )
    init = (jnp.int32(0), cache, batch, ~live, bufs, jnp.zeros((S, V), jnp.float32), feats)
    n, cache, _, _, bufs, logits, feats = jax.lax.while_loop(cond, body, init)
    return StepOutput(*bufs, n, logits, jnp.full(S, n, jnp.int32), features=feats), cache
