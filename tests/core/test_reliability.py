"""Reliability of the engine under ordinary and careless input: requests
with n > 1 beside others never overfill a step (each answer equal to a lone
n = 1 run with that answer's seed), and bad values that once crashed with
an unnamed error are named."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.requests import child_seed
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama

CFG = ModelConfig(
    architecture="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    eos_token_ids=(),
)
SEATS = 8


@pytest.fixture(scope="module")
def model():
    return Llama.random_init(CFG, seed=5)


def engine(model, **kw):
    opts = dict(
        warmup=False, num_pages=160, page_size=8, max_num_seqs=SEATS, max_num_batched_tokens=64
    )
    return LLMEngine(model, None, EngineConfig(**{**opts, **kw}))


def drain(eng, cap=SEATS, max_steps=2000):
    """Step `eng` until idle: every request's final output, once each; no
    step holds more than `cap` sequences."""
    done = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return done
        for o in eng.step():
            assert len(eng.scheduler.running) <= cap
            if o.finished:
                assert o.request_id not in done, "a request ended twice"
                done[o.request_id] = o
        assert len(eng.scheduler.running) <= cap
    raise AssertionError("the engine did not finish")


def prompt(i, n=20):
    return [int(t) for t in (np.arange(n) * 7 + i * 13) % 90 + 3]


def test_many_n2_requests_never_overfill_a_step_and_equal_lone_runs(model):
    # 40 prompts of 20 tokens, n = 2: admitted while earlier ones still
    # prefilled before their fork, they once made steps of 14 sequences in 8 seats.
    eng = engine(model, max_num_batched_tokens=256)
    params = [
        SamplingParams(n=2, max_tokens=8, temperature=1.0, seed=100 + i, ignore_eos=True)
        for i in range(40)
    ]
    rids = [eng.add_request(prompt(i), p) for i, p in enumerate(params)]
    done = drain(eng)
    assert set(done) == set(rids)
    lone = engine(model, max_num_seqs=1, enable_prefix_caching=False)
    for i in (0, 1, 17, 39):
        out = done[rids[i]]
        assert out.error is None and [c.index for c in out.outputs] == [0, 1]
        for c in out.outputs:
            rid = lone.add_request(
                prompt(i),
                SamplingParams(
                    max_tokens=8,
                    temperature=1.0,
                    seed=child_seed(100 + i, c.index),
                    ignore_eos=True,
                ),
            )
            assert c.token_ids == lone.run_to_completion([rid])[rid].outputs[0].token_ids
    assert all(len(c.token_ids) == 8 for o in done.values() for c in o.outputs)


def test_a_wide_request_beside_streams_admitted_later(model):
    # One n = 7 request (all 8 seats with the request already running),
    # then another: it waits for a seat instead of overfilling the step.
    eng = engine(model)
    first = eng.add_request(prompt(1), SamplingParams(max_tokens=12, temperature=0.0))
    eng.step()
    wide = eng.add_request(prompt(2, 30), SamplingParams(n=7, max_tokens=6, temperature=0.0))
    late = eng.add_request(prompt(3), SamplingParams(max_tokens=6, temperature=0.0))
    done = drain(eng)
    assert set(done) == {first, wide, late}
    lone = engine(model, max_num_seqs=1, enable_prefix_caching=False)
    for rid, p, n in ((first, prompt(1), 12), (wide, prompt(2, 30), 6), (late, prompt(3), 6)):
        ref = lone.run_to_completion(
            [lone.add_request(p, SamplingParams(max_tokens=n, temperature=0.0))]
        )
        want = next(iter(ref.values())).outputs[0].token_ids
        assert all(c.token_ids == want for c in done[rid].outputs), rid
    assert len(done[wide].outputs) == 7


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    reqs=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 30), st.integers(1, 5)), min_size=1, max_size=10
    )
)
def test_any_mix_of_n_and_lengths_fills_at_most_the_seats(shared, reqs):
    eng = shared
    rids = {
        eng.add_request(
            prompt(i, length), SamplingParams(n=n, max_tokens=m, temperature=0.0, ignore_eos=True)
        ): (n, m)
        for i, (n, length, m) in enumerate(reqs)
    }
    done = drain(eng, cap=4)
    assert set(done) == set(rids)
    for rid, (n, m) in rids.items():
        assert [len(c.token_ids) for c in done[rid].outputs] == [m] * n
    assert eng.bm.num_used_pages == 0  # every page back


@pytest.fixture(scope="module")
def shared(model):
    return engine(model, max_num_seqs=4, num_pages=40, max_num_batched_tokens=16)
