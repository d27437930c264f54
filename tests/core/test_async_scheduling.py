"""Overlapped scheduling: step N+1 is dispatched before step N's tokens are
read, its decoding rows take their input token on the device. Outputs must
be those of the synchronous engine (itself checked against lone runs and
Hugging Face elsewhere), token for token, under stops, max_tokens, aborts,
preemption, chunked prefill and prefix hits; sequences that finish in
flight give their pages back. (Sharded: tests/test_sharding.py's
two-process job schedules with overlap.)"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama
from tests.helpers.model_utils import WORDS, make_hf_model, save_tiny_tokenizer

CFG = ModelConfig(
    architecture="llama",
    vocab_size=211,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    eos_token_ids=(),
)


@pytest.fixture(scope="module")
def model():
    return Llama.random_init(CFG, seed=1)


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    prefixes = [list(rng.integers(0, 211, k)) for k in (24, 40, 17)]
    return [
        (prefixes[i % 3] if i % 4 else []) + list(rng.integers(0, 211, int(rng.integers(1, 30))))
        for i in range(n)
    ]


def _params(i):
    """Greedy and seeded sampling, stop tokens, min_tokens, logprobs, and
    max_tokens from 1 on (a sequence whose first token is its last)."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9, seed=i, top_k=20),
        dict(temperature=0.7, seed=i, top_p=0.9, stop_token_ids=[3, 9, 27, 31, 44]),
        dict(temperature=0.0, stop_token_ids=[5, 7, 11, 13], min_tokens=2, logprobs=3),
        dict(temperature=1.0, seed=i, min_p=0.05, logprobs=1),
    ]
    return SamplingParams(max_tokens=1 + (i * 7) % 23, **kinds[i % len(kinds)])


def _engine(model, asyn, **kw):
    opts = dict(
        warmup=False,
        num_pages=24,
        page_size=8,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        async_scheduling=asyn,
    )
    return LLMEngine(model, None, EngineConfig(**{**opts, **kw}))


def _outputs(final, ids):
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in (final[r].outputs[0] for r in ids)]


def _same(a, b, i):
    """Tokens and finish reasons exactly; log-probabilities (and their top
    ids) to float32 rounding: a step's batch shape differs between the two
    engines, and with it XLA's summation order."""
    assert a[:2] == b[:2], f"request {i} differs from the synchronous engine"
    assert (a[2] is None) == (b[2] is None)
    for x, y in zip(a[2] or (), b[2] or ()):
        assert x.token_id == y.token_id and list(x.top) == list(y.top), f"request {i}"
        np.testing.assert_allclose(
            [x.logprob, *x.top.values()], [y.logprob, *y.top.values()], rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("num_decode_steps", [1, 4])
def test_outputs_equal_the_synchronous_engine(model, num_decode_steps):
    prompts = _prompts(48)
    got = {}
    for asyn in (False, True):
        eng = _engine(model, asyn, num_decode_steps=num_decode_steps)
        ids = [eng.add_request(p, _params(i)) for i, p in enumerate(prompts)]
        got[asyn] = _outputs(eng.run_to_completion(), ids)
        if asyn:
            assert eng.stats["overlapped_steps"] > 0.5 * eng.stats["steps"]
            assert eng.scheduler.num_preemptions > 0, "pool too large: no preemption happened"
            assert eng.bm.prefix_hit_tokens > 0, "no prefix cache hit happened"
            assert eng.stats["partial_prefills"] > 0, "no prompt was split across steps"
            assert eng.bm.num_used_pages == 0, "pages leaked"
        else:
            assert eng.stats["overlapped_steps"] == 0
    assert [o[1] for o in got[True]].count("stop") > 3
    for i, (a, b) in enumerate(zip(got[False], got[True])):
        _same(a, b, i)


def test_greedy_equals_a_lone_uncached_run(model):
    prompts = _prompts(12, seed=3)
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    eng = _engine(model, True)
    ids = [eng.add_request(p, greedy) for p in prompts]
    final = eng.run_to_completion()
    for i, p in enumerate(prompts):
        lone = LLMEngine(
            model,
            None,
            EngineConfig(
                warmup=False,
                num_pages=80,
                page_size=8,
                enable_prefix_caching=False,
                async_scheduling=False,
                num_decode_steps=1,
            ),
        )
        r = lone.add_request(p, greedy)
        assert (
            final[ids[i]].outputs[0].token_ids == lone.run_to_completion()[r].outputs[0].token_ids
        ), f"request {i}"


def test_aborts_in_flight_and_arrivals_between_steps(model):
    """Requests arrive while steps are in flight and some are aborted while
    in flight: the others equal the synchronous engine, an aborted one ends
    "abort" with a prefix of its synchronous tokens, no page leaks."""
    prompts = _prompts(24, seed=5)
    runs = {}
    for asyn in (False, True):
        eng = _engine(model, asyn, num_decode_steps=2)
        ids, final, aborted = [], {}, set()
        for step in range(10_000):
            if step < len(prompts):  # one arrival per step
                ids.append(eng.add_request(prompts[step], _params(step)))
            if step in (6, 9, 15):  # abort the oldest unfinished request
                victim = next(r for r in ids if r not in final and r not in aborted)
                eng.abort(victim)
                aborted.add(victim)
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o
            if len(final) == len(prompts):
                break
        assert len(final) == len(prompts)
        assert eng.bm.num_used_pages == 0, "pages leaked"
        runs[asyn] = (ids, final, aborted)
    (ids0, f0, ab0), (ids1, f1, ab1) = runs[False], runs[True]
    for i, (r0, r1) in enumerate(zip(ids0, ids1)):
        a, b = f0[r0].outputs[0], f1[r1].outputs[0]
        if r1 in ab1:
            assert b.finish_reason == "abort"
            if r0 not in ab0:
                assert a.token_ids[: len(b.token_ids)] == b.token_ids
        elif r0 not in ab0:
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), f"request {i}"


def test_requests_that_need_the_host_run_synchronously_and_equal(model):
    """Penalties and logit bias need the host between tokens: while such a
    request runs, steps are not overlapped; outputs still equal."""
    prompts = _prompts(10, seed=7)
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5)
        if i == 3
        else SamplingParams(max_tokens=12, temperature=0.0, logit_bias={4: 5.0})
        if i == 6
        else _params(i)
        for i in range(len(prompts))
    ]
    outs = {}
    for asyn in (False, True):
        eng = _engine(model, asyn)
        ids = [eng.add_request(p, params[i]) for i, p in enumerate(prompts)]
        outs[asyn] = _outputs(eng.run_to_completion(), ids)
    for i, (a, b) in enumerate(zip(outs[False], outs[True])):
        _same(a, b, i)


def test_stop_strings_end_sequences_in_flight(tmp_path):
    """Stop strings are checked on the host: the token after the stop,
    already computed by the step in flight, is discarded."""
    _, path = make_hf_model("llama", tmp_path)
    save_tiny_tokenizer(path)
    outs = {}
    for asyn in (False, True):
        eng = LLMEngine.from_pretrained(
            str(path),
            num_pages=64,
            page_size=8,
            warmup=False,
            async_scheduling=asyn,
            num_decode_steps=1,
        )
        prompts = [" ".join(WORDS[i : i + 5 + i % 4]) for i in range(8)]
        # stop on a word the greedy answer to prompt 0 contains
        base = eng.add_request(
            prompts[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        )
        text = eng.run_to_completion()[base].outputs[0].text
        stop = text.split()[3] if len(text.split()) > 3 else text[-3:]
        ids = [
            eng.add_request(
                p, SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], ignore_eos=True)
            )
            for p in prompts
        ]
        final = eng.run_to_completion()
        outs[asyn] = [
            (
                final[r].outputs[0].text,
                final[r].outputs[0].token_ids,
                final[r].outputs[0].finish_reason,
            )
            for r in ids
        ]
        if asyn:
            assert eng.stats["overlapped_steps"] > 0
    assert outs[True][0][2] == "stop" and stop not in outs[True][0][0]
    assert outs[False] == outs[True]


def test_server_streams_with_overlap_equal_offline(tmp_path):
    """`jaxkv serve` with overlapped scheduling, 6 concurrent streaming
    `openai` clients (one disconnects early): each finished stream joins to
    the text of a lone synchronous offline run."""
    import concurrent.futures

    import openai

    from jaxkv import LLM
    from jaxkv.entrypoints.openai.server import build_app
    from tests.helpers.serve_utils import ThreadServer

    _, path = make_hf_model("llama", tmp_path)
    save_tiny_tokenizer(path)
    opts = dict(num_pages=96, page_size=8, warmup=False, num_decode_steps=2)
    eng = LLMEngine.from_pretrained(str(path), max_num_seqs=8, async_scheduling=True, **opts)
    oracle = LLM(str(path), max_num_seqs=1, async_scheduling=False, **opts)
    prompts = [" ".join(WORDS[i : i + 3 + i % 5]) for i in range(6)]
    srv = ThreadServer(build_app(eng, ["tiny"]))
    try:
        client = openai.OpenAI(
            base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=120
        )

        def one(i):
            stream = client.completions.create(
                model="tiny", prompt=prompts[i], max_tokens=16, temperature=0, stream=True
            )
            text = ""
            for n, ch in enumerate(stream):
                text += ch.choices[0].text
                if i == 5 and n == 1:  # this client goes away mid-answer
                    stream.close()
                    return None
            return text

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(one, range(6)))
    finally:
        srv.stop()
    assert eng.stats["overlapped_steps"] > 0
    for i in range(5):
        ref = oracle.generate(prompts[i], SamplingParams(max_tokens=16, temperature=0))[0]
        assert got[i] == ref.outputs[0].text, f"prompt {i}"
