"""The engine: batch invariance under preemption, chunked prefill and prefix
caching; prefix caching saves work; every request ends with a reason."""

import numpy as np
import pytest

from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama
from tests.helpers.compile_count import count_compiles

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
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return Llama.random_init(CFG, seed=1)


def _alone(model, prompt, params=GREEDY):
    eng = LLMEngine(
        model,
        None,
        EngineConfig(
            warmup=False,
            num_pages=80,
            page_size=8,
            max_num_seqs=4,
            max_num_batched_tokens=128,
            enable_prefix_caching=False,
        ),
    )
    rid = eng.add_request(prompt, params)
    return eng.run_to_completion()[rid].outputs[0].token_ids


def test_batch_invariance_with_preemption_chunking_and_prefix_hits(model):
    rng = np.random.default_rng(0)
    prefixes = [list(rng.integers(0, 211, n)) for n in (24, 40, 17)]
    prompts = []
    for i in range(64):
        pre = prefixes[i % 3] if i % 4 else []
        prompts.append(pre + list(rng.integers(0, 211, int(rng.integers(1, 30)))))
    eng = LLMEngine(
        model,
        None,
        EngineConfig(
            warmup=False, num_pages=40, page_size=8, max_num_seqs=16, max_num_batched_tokens=64
        ),
    )
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    final = eng.run_to_completion()
    assert eng.scheduler.num_preemptions > 0, "pool too large: no preemption happened"
    assert eng.bm.prefix_hit_tokens > 0, "no prefix cache hit happened"
    assert eng.stats["partial_prefills"] > 0, "no prompt was split across steps"
    for i, p in enumerate(prompts):
        got = final[ids[i]].outputs[0]
        assert got.finish_reason == "length"
        assert got.token_ids == _alone(model, p), f"request {i} differs from its lone run"


def test_prefix_cache_prefills_only_new_tokens(model):
    rng = np.random.default_rng(1)
    shared = list(rng.integers(0, 211, 64))
    a, b = shared + [5, 6, 7], shared + [9, 10, 11, 12, 13]
    eng = LLMEngine(model, None, EngineConfig(warmup=False, num_pages=64, page_size=8))
    eng.add_request(a, GREEDY)
    eng.run_to_completion()
    before = eng.stats["prompt_tokens_computed"]
    rb = eng.add_request(b, GREEDY)
    out = eng.run_to_completion()[rb]
    assert out.num_cached_tokens == 64
    assert eng.stats["prompt_tokens_computed"] - before == len(b) - 64
    assert out.outputs[0].token_ids == _alone(model, b)


def test_every_request_finishes_with_a_reason(model):
    eng = LLMEngine(
        model,
        None,
        EngineConfig(
            warmup=False, num_pages=24, page_size=8, max_num_seqs=8, max_num_batched_tokens=64
        ),
    )
    ok = [
        eng.add_request(list(range(1, 10 + i)), SamplingParams(max_tokens=30, temperature=0))
        for i in range(4)
    ]
    bad = {
        "empty": eng.add_request([], GREEDY),
        "unknown token": eng.add_request([1, 5000], GREEDY),
        "top_p": eng.add_request([1, 2], SamplingParams(top_p=1.5)),
        "max_tokens": eng.add_request([1, 2], SamplingParams(max_tokens=-1)),
        "too long for the pool": eng.add_request(
            list(range(1, 150)), SamplingParams(max_tokens=60)
        ),
        "text without tokenizer": eng.add_request("hello", GREEDY),
    }
    fields = {
        "empty": "prompt_token_ids",
        "unknown token": "prompt_token_ids",
        "top_p": "top_p",
        "max_tokens": "max_tokens",
        "too long for the pool": "prompt",
        "text without tokenizer": "prompt",
    }
    stream = {}
    aborted = ok[1]
    seen_abort = False
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            stream.setdefault(o.request_id, []).extend(o.outputs[0].delta_token_ids)
            if o.finished:
                final[o.request_id] = o
        if not seen_abort and len(stream.get(aborted, [])) >= 3:
            eng.abort(aborted)
            seen_abort = True
    assert set(final) == set(ok) | set(bad.values())
    for name, rid in bad.items():
        assert final[rid].outputs[0].finish_reason == "error"
        assert fields[name] in final[rid].error, (name, final[rid].error)
    assert final[aborted].outputs[0].finish_reason == "abort"
    assert 3 <= len(final[aborted].outputs[0].token_ids) < 30
    for rid in ok:
        if rid != aborted:
            assert final[rid].outputs[0].finish_reason == "length"
            assert len(final[rid].outputs[0].token_ids) == 30
            # Streaming deltas add up to the final output.
            assert stream[rid] == final[rid].outputs[0].token_ids


def test_stop_token_and_seeded_sampling(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = _alone(model, prompt, SamplingParams(max_tokens=10, temperature=0))
    stop_at = ref[4]
    eng = LLMEngine(model, None, EngineConfig(warmup=False, num_pages=64, page_size=8))
    r = eng.add_request(
        prompt, SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at])
    )
    out = eng.run_to_completion()[r].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.token_ids == ref[: ref.index(stop_at) + 1]
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    a = _alone(model, prompt, sp)
    # The same seed gives the same tokens inside a busy batch.
    eng = LLMEngine(model, None, EngineConfig(warmup=False, num_pages=64, page_size=8))
    for i in range(5):
        eng.add_request([7 + i] * (3 + i), SamplingParams(max_tokens=12, temperature=1.0))
    r = eng.add_request(prompt, sp)
    assert eng.run_to_completion()[r].outputs[0].token_ids == a


def test_multi_step_decode_matches_single_steps(model):
    rng = np.random.default_rng(5)
    prompts = [list(rng.integers(0, 211, int(rng.integers(2, 20)))) for _ in range(6)]
    ref_tokens = _alone(model, prompts[0], SamplingParams(max_tokens=13, temperature=0))
    params = [
        SamplingParams(max_tokens=13, temperature=0),  # not a multiple of K
        SamplingParams(max_tokens=20, temperature=0.9, top_k=20, seed=7, logprobs=3),
        SamplingParams(max_tokens=9, temperature=0, stop_token_ids=[ref_tokens[5]]),
        SamplingParams(max_tokens=20, temperature=1.0, min_p=0.05, seed=1),
        SamplingParams(max_tokens=3, temperature=0),
        SamplingParams(max_tokens=17, temperature=0, min_tokens=4),
    ]
    prompts[2] = prompts[0]

    def run(k):
        eng = LLMEngine(
            model, None, EngineConfig(warmup=False, num_pages=64, page_size=8, num_decode_steps=k)
        )
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        out = eng.run_to_completion()
        return eng, [out[i].outputs[0] for i in ids]

    eng1, single = run(1)
    eng8, multi = run(8)
    assert eng8.stats.get("decode_steps", 0) > eng8.stats["steps"], "no multi-step call ran"
    for a, b in zip(single, multi):
        assert a.token_ids == b.token_ids
        assert a.finish_reason == b.finish_reason
    assert multi[2].finish_reason == "stop" and multi[2].token_ids[-1] == ref_tokens[5]
    lp1 = [x.logprob for x in single[1].logprobs]
    lp8 = [x.logprob for x in multi[1].logprobs]
    np.testing.assert_allclose(lp8, lp1, rtol=1e-4, atol=1e-4)
    assert list(multi[1].logprobs[0].top) == list(single[1].logprobs[0].top)


def test_after_warm_up_two_hundred_mixed_requests_compile_nothing(model):
    eng = LLMEngine(
        model,
        None,
        EngineConfig(num_pages=128, page_size=8, max_num_seqs=16, max_num_batched_tokens=64),
    )
    warmed = set(eng.runner.compiled)
    assert warmed == set(eng.runner.program_keys())
    assert eng.warmup_report["programs"] == len(warmed)
    rng = np.random.default_rng(9)
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=20),
        dict(temperature=1.0, top_p=0.9, min_p=0.05, seed=3),
        dict(temperature=0.0, logprobs=3),
        dict(temperature=0.7, repetition_penalty=1.2, presence_penalty=0.5),
        dict(temperature=0.0, stop_token_ids=[5, 7], min_tokens=2),
    ]
    with count_compiles() as compiles:
        for i in range(200):
            eng.add_request(
                list(rng.integers(0, 211, int(rng.integers(1, 150)))),
                SamplingParams(max_tokens=int(rng.integers(1, 40)), **kinds[i % 6]),
            )
            if i % 20 == 19:  # requests keep arriving while others run
                for _ in range(3):
                    eng.step()
        final = eng.run_to_completion()
    assert len(final) >= 180  # the rest finished during the interleaved steps
    assert eng.scheduler.num_preemptions > 0 and eng.stats["decode_steps"] > eng.stats["steps"]
    print(
        f"warm-up: {len(warmed)} programs in {eng.warmup_report['seconds']:.1f} s; "
        f"200 requests: {len(compiles)} compiles"
    )
    assert compiles == [], f"{len(compiles)} XLA compiles after warm-up"
    assert set(eng.runner.compiled) == warmed
