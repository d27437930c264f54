"""Bad input at the edges of the engine: each a named error for that request
while the others are served, never a crash; and the Python API shared by
threads."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoints.hf_config import from_hf_config
from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
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
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def model():
    return Llama.random_init(CFG, seed=4)


def engine(model, **kw):
    opts = dict(warmup=False, num_pages=64, page_size=8, max_num_seqs=8, max_num_batched_tokens=32)
    return LLMEngine(model, None, EngineConfig(**{**opts, **kw}))


def lone(model, prompt, params=GREEDY):
    eng = engine(model)
    rid = eng.add_request(prompt, params)
    return eng.run_to_completion()[rid].outputs[0].token_ids


@pytest.mark.parametrize(
    "params,field",
    [
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(stop=["ok", 3]), "stop"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(max_tokens="7"), "max_tokens"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(stop="\ud800"), "stop"),
        (dict(n=0), "n"),
        (dict(n=9), "n"),  # the engine holds 8 sequences
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={3: "big"}), "logit_bias"),
        (dict(logit_bias={"\u00b2": 1}), "logit_bias"),
        (dict(logit_bias={"\u0663": 1}), "logit_bias"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[10**6]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(bad_words="no"), "bad_words"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
        (dict(structured_outputs={"regex": 5}), "structured_outputs"),
        (dict(structured_outputs={"json": {}, "regex": "a"}), "structured_outputs"),
    ],
)
def test_bad_sampling_values_are_named_errors_beside_good_requests(model, params, field):
    eng = engine(model)
    good = eng.add_request([1, 2, 3], GREEDY)
    bad = eng.add_request([4, 5], SamplingParams(**params))
    out = eng.run_to_completion()
    assert out[bad].outputs[0].finish_reason == "error"
    assert out[bad].error.startswith(field), out[bad].error
    assert out[good].outputs[0].token_ids == lone(model, [1, 2, 3])


@pytest.mark.parametrize(
    "prompt,field",
    [
        ({"prompt_token_ids": 5}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, "a"]}, "prompt_token_ids"),
        (np.zeros((2, 2), np.int32), "prompt_token_ids"),
        ({"text": "x"}, "prompt"),
        (3.5, "prompt"),
    ],
)
def test_bad_prompts_are_named_errors(model, prompt, field):
    eng = engine(model)
    rid = eng.add_request(prompt, GREEDY)
    out = eng.run_to_completion()[rid]
    assert out.outputs[0].finish_reason == "error" and out.error.startswith(field), out.error


def test_huge_top_k_samples_from_the_whole_vocabulary(model):
    eng = engine(model)
    rid = eng.add_request(
        [1, 2], SamplingParams(max_tokens=5, temperature=1.0, top_k=3 * 10**9, seed=1)
    )
    same = eng.add_request([1, 2], SamplingParams(max_tokens=5, temperature=1.0, top_k=0, seed=1))
    out = eng.run_to_completion()
    assert out[rid].outputs[0].finish_reason == "length"
    assert out[rid].outputs[0].token_ids == out[same].outputs[0].token_ids  # top_k >= V is off


def test_auto_ids_never_collide_with_caller_ids(model):
    eng = engine(model)
    mine = [eng.add_request([1, 2], GREEDY, request_id=str(i)) for i in range(3)]
    auto = [eng.add_request([3, 4], GREEDY) for _ in range(3)]
    assert len(set(mine + auto)) == 6
    assert set(eng.run_to_completion()) == set(mine + auto)


def test_unchunked_prompt_longer_than_a_step_is_refused_and_starves_nobody(model):
    eng = engine(model, enable_chunked_prefill=False, max_num_batched_tokens=16)
    long = eng.add_request(list(range(1, 30)), GREEDY)
    short = eng.add_request([1, 2, 3], GREEDY)
    out = eng.run_to_completion()
    assert out[long].outputs[0].finish_reason == "error"
    assert "max_num_batched_tokens" in out[long].error and out[long].error.startswith("prompt")
    assert out[short].outputs[0].token_ids == lone(model, [1, 2, 3])


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(max_model_len=-5), "max_model_len"),
        (dict(num_pages=1), "num_pages"),
        (dict(kv_cache_memory=0), "kv_cache_memory"),
        (dict(kv_dtype="int3"), "kv_dtype"),
    ],
)
def test_bad_engine_options_are_refused_at_start(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineConfig(**kw)


@pytest.mark.parametrize(
    "key,value",
    [
        ("max_position_embeddings", None),
        ("rms_norm_eps", None),
        ("hidden_size", "big"),
        ("vocab_size", None),
    ],
)
def test_config_json_nulls_and_bad_types(key, value):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    cfg[key] = value
    if value is None and key != "vocab_size":  # optional: its default
        assert (
            getattr(from_hf_config(cfg), key)
            == {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6}[key]
        )
    else:
        with pytest.raises(ValueError, match=f"^{key}"):
            from_hf_config(cfg)


def test_non_finite_weights_end_the_request_with_an_error(model):
    bad = Llama.random_init(CFG, seed=4)
    bad.final_norm[...] = jnp.full_like(bad.final_norm[...], jnp.nan)
    eng = engine(bad)
    rid = eng.add_request([1, 2, 3], GREEDY)
    out = eng.run_to_completion()[rid]
    assert out.outputs[0].finish_reason == "error" and "not finite" in out.error
    assert out.outputs[0].token_ids == []


def test_two_threads_share_one_llm(tmp_path):
    from jaxkv import LLM
    from tests.helpers.model_utils import make_hf_model

    _, path = make_hf_model("llama", tmp_path)
    llm = LLM(
        str(path),
        warmup=False,
        num_pages=64,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    prompts = [[[1 + i, 2 + j] for j in range(3)] for i in range(2)]
    want = [[o.outputs[0].token_ids for o in llm.generate(p, GREEDY)] for p in prompts]
    got, errors = [None, None], []

    def run(i):
        try:
            for _ in range(3):
                got[i] = [o.outputs[0].token_ids for o in llm.generate(prompts[i], GREEDY)]
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and got == want
    assert jax.default_backend()  # the engine still works after both


ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.integers(0, 5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(-3, 200), st.text(max_size=3)), max_size=3),
    st.dictionaries(
        st.one_of(st.integers(-3, 200), st.text(max_size=3)),
        st.one_of(st.floats(-200, 200), st.text(max_size=2)),
        max_size=3,
    ),
)
FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


@pytest.fixture(scope="module")
def shared(model):
    return engine(model, max_num_seqs=4), lone(model, [5, 6, 7])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=st.dictionaries(st.sampled_from(FIELDS), ANY, min_size=1, max_size=4),
    prompt=st.one_of(
        st.lists(st.integers(-5, 120), max_size=6), st.text(max_size=5), st.none(), st.integers()
    ),
)
def test_any_request_ends_once_named_and_leaves_others_alone(shared, values, prompt):
    eng, control = shared
    ok = eng.add_request([5, 6, 7], GREEDY)
    try:
        params = SamplingParams(**values)
    except TypeError:  # not a SamplingParams field combination at all
        return
    if isinstance(params.max_tokens, int) and not isinstance(params.max_tokens, bool):
        params.max_tokens = min(max(params.max_tokens, -1), 8)
    rid = eng.add_request(prompt, params)
    seen = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                assert o.request_id not in seen, "a request ended twice"
                seen[o.request_id] = o
    assert set(seen) == {ok, rid}
    assert seen[ok].outputs[0].token_ids == control
    out = seen[rid]
    if out.outputs[0].finish_reason == "error":
        assert out.error.split(":")[0] in FIELDS + ("prompt", "prompt_token_ids"), out.error
    else:
        assert out.outputs[0].finish_reason in ("stop", "length")
