"""The in-jit sampler against numpy oracles."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.worker.sampler import argmax, sample
from jaxkv.worker.step_batch import PenaltyBatch, SamplingBatch

V = 40


class _Batch(NamedTuple):
    sampling: SamplingBatch
    num_output: jax.Array
    penalties: PenaltyBatch


def _batch(
    S,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    seeds=None,
    index=None,
    presence=0.0,
    frequency=0.0,
    repetition=1.0,
    history=None,
    is_output=None,
    logprobs=0,
):
    f = lambda v: jnp.broadcast_to(jnp.asarray(v, jnp.float32), (S,))  # noqa: E731
    i = lambda v: jnp.broadcast_to(jnp.asarray(v, jnp.int32), (S,))  # noqa: E731
    hist = np.zeros((S, 0), np.int32) if history is None else history
    sb = SamplingBatch(
        temperature=f(temperature),
        top_k=i(top_k),
        top_p=f(top_p),
        min_p=f(min_p),
        seeds=jnp.asarray(np.arange(S) if seeds is None else seeds, jnp.uint32),
        num_logprobs=i(logprobs),
        presence_penalty=f(presence),
        frequency_penalty=f(frequency),
        repetition_penalty=f(repetition),
    )
    pen = PenaltyBatch(
        history=jnp.asarray(hist),
        history_is_output=jnp.asarray(
            np.zeros(hist.shape, bool) if is_output is None else is_output
        ),
    )
    return _Batch(sb, jnp.asarray(np.zeros(S) if index is None else index, jnp.int32), pen)


_jit_sample = jax.jit(sample, static_argnames=("num_top_logprobs",))


def _sample(logits, b: _Batch, rng, num_top_logprobs=0):
    return _jit_sample(logits, b.sampling, rng, b.num_output, num_top_logprobs=num_top_logprobs)


RNG = jax.random.key(0)


def _logits(S, seed=0):
    return np.random.default_rng(seed).normal(0, 2, (S, V)).astype(np.float32)


def test_temperature_zero_is_argmax():
    logits = _logits(16)
    for all_greedy in (False, True):
        # With one sampled row beside them the draw runs; greedy rows still argmax.
        temps = np.zeros(16, np.float32) if all_greedy else np.r_[np.zeros(15), 1.0]
        out = _sample(jnp.asarray(logits), _batch(16, temperature=temps), RNG)
        np.testing.assert_array_equal(np.asarray(out.token_ids)[:15], logits.argmax(-1)[:15])


def test_top_k_never_outside_set():
    S = 512
    logits = np.tile(_logits(1), (S, 1))
    out = _sample(jnp.asarray(logits), _batch(S, top_k=3, temperature=2.0), RNG)
    allowed = set(np.argsort(-logits[0])[:3])
    assert set(np.asarray(out.token_ids)) <= allowed
    assert len(set(np.asarray(out.token_ids))) == 3  # and it does use the whole set


def test_top_p_never_outside_nucleus():
    S = 512
    logits = np.tile(_logits(1, seed=5), (S, 1))
    p = np.exp(logits[0] - logits[0].max())
    p /= p.sum()
    order = np.argsort(-p)
    n = int(np.searchsorted(np.cumsum(p[order]), 0.6) + 1)  # smallest prefix with mass >= 0.6
    out = _sample(jnp.asarray(logits), _batch(S, top_p=0.6), RNG)
    assert set(np.asarray(out.token_ids)) <= set(order[:n])


def test_min_p_drops_unlikely_tokens():
    S = 512
    logits = np.tile(_logits(1, seed=6), (S, 1))
    p = np.exp(logits[0] - logits[0].max())
    out = _sample(jnp.asarray(logits), _batch(S, min_p=0.2), RNG)
    assert set(np.asarray(out.token_ids)) <= set(np.nonzero(p >= 0.2)[0])


def test_seeds_reproduce_and_differ():
    logits = jnp.asarray(np.tile(_logits(1), (64, 1)))
    a = _sample(logits, _batch(64, seeds=np.full(64, 7), index=np.arange(64)), RNG).token_ids
    b = _sample(logits, _batch(64, seeds=np.full(64, 7), index=np.arange(64)), RNG).token_ids
    c = _sample(logits, _batch(64, seeds=np.full(64, 8), index=np.arange(64)), RNG).token_ids
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()
    # A request's draw does not depend on its row in the batch.
    perm = np.random.default_rng(0).permutation(64)
    d = _sample(logits, _batch(64, seeds=np.full(64, 7), index=np.arange(64)[perm]), RNG).token_ids
    np.testing.assert_array_equal(np.asarray(d), np.asarray(a)[perm])


def test_empirical_frequencies_match_softmax():
    # 8 tokens, temperature 0.7, 40k draws with a fixed seed. Each frequency's
    # standard error is <= sqrt(0.25 / 40000) = 0.0025; tolerance 0.01 (4 sigma).
    V8, N, T = 8, 40000, 0.7
    base = np.random.default_rng(3).normal(0, 1, V8).astype(np.float32)
    logits = np.tile(base, (N, 1))
    out = _sample(
        jnp.asarray(logits), _batch(N, temperature=T, seeds=np.full(N, 11), index=np.arange(N)), RNG
    )
    freq = np.bincount(np.asarray(out.token_ids), minlength=V8) / N
    p = np.exp(base / T - (base / T).max())
    p /= p.sum()
    assert np.abs(freq - p).max() < 0.01, (freq, p)


def test_logprobs_are_raw_log_softmax():
    logits = _logits(4, seed=9)
    out = _sample(
        jnp.asarray(logits), _batch(4, temperature=0.0, logprobs=5), RNG, num_top_logprobs=5
    )
    ref = logits - logits.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprob, ref[np.arange(4), logits.argmax(-1)], atol=1e-5)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-logits, axis=-1)[:, :5])
    np.testing.assert_allclose(out.top_logprobs, np.sort(ref, -1)[:, ::-1][:, :5], atol=1e-5)


def test_penalties_match_numpy():
    logits = _logits(2, seed=10)
    hist = np.array([[3, 3, 5, 7, -1], [1, 2, 2, 2, 9]], np.int32)
    is_out = np.array([[False, True, True, True, False], [False, False, True, True, True]])
    sb = _batch(
        2,
        temperature=0.0,
        presence=0.5,
        frequency=0.25,
        repetition=1.3,
        history=hist,
        is_output=is_out,
    )
    from jaxkv.worker.sampler import apply_penalties

    got = np.asarray(apply_penalties(jnp.asarray(logits), sb.sampling, sb.penalties))
    want = logits.copy()
    for s in range(2):
        seen = {t for t in hist[s] if t >= 0}
        for t in seen:
            want[s, t] = want[s, t] / 1.3 if want[s, t] > 0 else want[s, t] * 1.3
        counts = {}
        for t, o in zip(hist[s], is_out[s]):
            if t >= 0 and o:
                counts[t] = counts.get(t, 0) + 1
        for t, c in counts.items():
            want[s, t] -= 0.25 * c + 0.5
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_argmax_is_numpys_first_maximum():
    """The two-reduction argmax against numpy's: ties go to the first id,
    infinities, -inf rows and one-column rows; a row with a NaN (the engine
    fails it) gets an id in range."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 1000)).astype(np.float32)
    x[1, [3, 700]] = 9.0  # a tie
    x[2, 9] = np.inf
    x[3] = -np.inf
    x[4, [0, 999]] = np.inf
    x[5, 998:] = 5.0
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), np.argmax(x, axis=-1))
    col = x[:, :1]
    np.testing.assert_array_equal(np.asarray(argmax(col)), np.zeros(6, np.int64))
    x[2, 5] = x[0, 999] = np.nan
    got = np.asarray(jax.jit(argmax)(x))
    assert ((0 <= got) & (got < 1000)).all()
    np.testing.assert_array_equal(got[[1, 3, 4, 5]], np.argmax(x, axis=-1)[[1, 3, 4, 5]])
