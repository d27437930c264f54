"""Speculative decoding is lossless: with n-gram and draft-model proposals
the engine's outputs are the ones it gives without speculation (greedy and
seeded sampling, every request option, under chunked prefill, prefix
caching and preemption); sampled tokens follow the target's distribution
(a chi-square test that a biased acceptance rule fails); the proposer and
the acceptance rule match hand-computed cases; nothing compiles after
warm-up."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2_contingency

from jaxkv.config import EngineConfig, ModelConfig, SpeculativeConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.core.spec.decode import ngram_lookup
from jaxkv.model.llama import Llama
from jaxkv.worker import verify
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
# adaptive off: every step with proposals verifies them (the strictest test).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}


@pytest.fixture(scope="module")
def model():
    return Llama.random_init(CFG, seed=1)


def _prompts(n, seed=0, vocab=211):
    """Prompts that repeat a motif (so n-gram lookup finds matches), some
    sharing prefixes (prefix-cache hits), of mixed lengths (chunking)."""
    rng = np.random.default_rng(seed)
    shared = list(rng.integers(0, vocab, 24))
    out = []
    for i in range(n):
        motif = list(rng.integers(0, vocab, int(rng.integers(2, 7))))
        body = motif * int(rng.integers(2, 6)) + list(
            rng.integers(0, vocab, int(rng.integers(0, 9)))
        )
        out.append((shared if i % 3 == 0 else []) + body)
    return out


def _params(i):
    """A mix of request options, all seeded where they sample."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9, top_k=20, seed=i, logprobs=2),
        dict(temperature=0.0, stop_token_ids=[7, 11], min_tokens=3),
        dict(temperature=1.0, top_p=0.9, min_p=0.05, seed=100 + i),
        dict(temperature=0.0, max_tokens=5),
        dict(temperature=0.7, seed=i, logprobs=1),
    ]
    kw = dict(max_tokens=20)
    kw.update(kinds[i % len(kinds)])
    return SamplingParams(**kw)


def _run(model, prompts, spec, draft=None, **engine):
    cfg = dict(warmup=False, num_pages=44, page_size=8, max_num_seqs=16, max_num_batched_tokens=64)
    cfg.update(engine)
    eng = LLMEngine(model, None, EngineConfig(speculative_config=spec, **cfg), draft_model=draft)
    ids = [eng.add_request(p, _params(i)) for i, p in enumerate(prompts)]
    final = eng.run_to_completion()
    eng.final = [final[r] for r in ids]
    return eng, [final[r].outputs[0] for r in ids]


def _same(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.token_ids == y.token_ids, f"request {i}: {x.token_ids} != {y.token_ids}"
        assert x.finish_reason == y.finish_reason, f"request {i}"
        if x.logprobs is not None:
            np.testing.assert_allclose(
                [p.logprob for p in x.logprobs],
                [p.logprob for p in y.logprobs],
                rtol=1e-4,
                atol=1e-4,
            )
            assert [list(p.top) for p in x.logprobs] == [list(p.top) for p in y.logprobs]


def _pressure(eng):
    assert eng.scheduler.num_preemptions > 0, "pool too large: no preemption happened"
    assert eng.bm.prefix_hit_tokens > 0, "no prefix cache hit happened"
    assert eng.stats["partial_prefills"] > 0, "no prompt was split across steps"


# ----------------------------------------------------------------- hand cases


def test_ngram_lookup_hand_cases():
    t = np.asarray
    # last 2 tokens [1, 2] occur at 0 and 4; the latest earlier place (4) wins
    assert ngram_lookup(t([1, 2, 3, 9, 1, 2, 5, 6, 1, 2]), 3, 3, 2) == [5, 6, 1]
    # the longest n first: [7, 1, 2] matches at 0 (followed by 8), [1, 2] alone later
    assert ngram_lookup(t([7, 1, 2, 8, 1, 2, 4, 7, 1, 2]), 2, 3, 2) == [8, 1]
    assert ngram_lookup(t([1, 2, 3, 4]), 3, 3, 1) == []  # no earlier occurrence
    assert ngram_lookup(t([5, 5]), 4, 3, 1) == [5]  # continuation capped by the sequence
    assert ngram_lookup(t([3]), 4, 3, 1) == []


def test_acceptance_rule_hand_cases():
    props = jnp.asarray([[4, 5, 6], [4, 5, 6], [4, 5, 6], [1, 2, 3]])
    draws = jnp.asarray([[4, 5, 6], [4, 9, 6], [9, 5, 6], [1, 2, 3]])
    n = jnp.asarray([3, 3, 3, 1])
    assert verify.num_accepted(props, n, draws).tolist() == [3, 1, 0, 1]


def test_speculative_config_is_checked():
    assert SpeculativeConfig.from_dict({"method": "ngram"}).num_speculative_tokens == 4
    for bad, name in (
        ({"method": "eagle"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "k": 2}, "unknown"),
        ({"method": "draft_model"}, "model"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "adaptive": "yes"}, "adaptive"),
    ):
        with pytest.raises(ValueError, match=name):
            EngineConfig(speculative_config=bad)


# ----------------------------------------------------------------- lossless


def test_ngram_outputs_equal_plain_decoding(model):
    prompts = _prompts(32)
    _, plain = _run(model, prompts, None)
    eng, spec = _run(model, prompts, NGRAM)
    _pressure(eng)
    m = eng.speculative_metrics()
    assert m["steps"] > 0 and m["accepted"] > 0, m
    _same(plain, spec)
    assert sum(o.metrics["spec_proposed"] for o in eng.final) == m["proposed"]
    assert sum(o.metrics["spec_accepted"] for o in eng.final) == m["accepted"]


def test_target_as_its_own_draft_accepts_everything(model):
    prompts = _prompts(32, seed=1)
    greedy = [dataclasses.replace(_params(0), max_tokens=24) for _ in prompts]
    outs = {}
    for spec in (
        None,
        {"method": "draft_model", "model": "self", "num_speculative_tokens": 3, "adaptive": False},
    ):
        eng = LLMEngine(
            model,
            None,
            EngineConfig(
                warmup=False,
                num_pages=40,
                page_size=8,
                max_num_seqs=16,
                max_num_batched_tokens=64,
                speculative_config=spec,
            ),
            draft_model=model if spec else None,
        )
        ids = [eng.add_request(p, g) for p, g in zip(prompts, greedy)]
        final = eng.run_to_completion()
        outs[spec is None] = [final[r].outputs[0].token_ids for r in ids]
        if spec:
            _pressure(eng)
            m = eng.speculative_metrics()
            assert m["proposed"] > 50 and m["accepted"] == m["proposed"], m
            assert all(
                final[r].metrics["spec_accepted"] == final[r].metrics["spec_proposed"] for r in ids
            )
    assert outs[True] == outs[False]


def test_random_draft_is_lossless_at_low_acceptance(model):
    draft = Llama.random_init(
        dataclasses.replace(CFG, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1), seed=7
    )
    prompts = _prompts(32, seed=2)
    _, plain = _run(model, prompts, None)
    eng, spec = _run(
        model,
        prompts,
        {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3, "adaptive": False},
        draft=draft,
    )
    _pressure(eng)
    m = eng.speculative_metrics()
    assert m["proposed"] > 50 and m["acceptance_rate"] < 0.3, m
    assert 0 < m["propose_share"] < 1
    _same(plain, spec)


def test_draft_must_share_the_vocabulary(model):
    other = Llama.random_init(dataclasses.replace(CFG, vocab_size=100), seed=3)
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(
            model,
            None,
            EngineConfig(
                warmup=False,
                num_pages=16,
                speculative_config={"method": "draft_model", "model": "other"},
            ),
            draft_model=other,
        )


# ----------------------------------------------------------------- distribution

SMALL = ModelConfig(
    architecture="llama",
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    max_position_embeddings=128,
    eos_token_ids=(),
)


def _first_tokens(model, spec, seeds, monkeypatch=None, rule=None):
    """The 4 output tokens of one prompt sampled once per seed (proposals
    are judged from the second on)."""
    if rule is not None:
        monkeypatch.setattr(verify, "num_accepted", rule)
    eng = LLMEngine(
        model,
        None,
        EngineConfig(
            warmup=False,
            num_pages=200,
            page_size=8,
            max_num_seqs=64,
            max_num_batched_tokens=256,
            num_decode_steps=1,
            speculative_config=spec,
            # a patched rule must be traced, not loaded
            program_cache=rule is None,
        ),
    )
    prompt = list(range(32)) * 2  # every token has been seen: n-gram lookup always proposes
    ids = [
        eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=int(s)))
        for s in seeds
    ]
    final = eng.run_to_completion()
    toks = np.asarray([final[r].outputs[0].token_ids for r in ids])
    return toks, eng.speculative_metrics()


def _homogeneous(a, b, V=32) -> float:
    """Smallest p-value of the two-sample chi-square tests on each token
    and on each step between consecutive tokens ((t[j+1] - t[j]) mod V, a
    function of their joint distribution)."""

    def features(t):
        return [t[:, j] for j in range(t.shape[1])] + [
            (t[:, j + 1] - t[:, j]) % V for j in range(t.shape[1] - 1)
        ]

    ps = []
    for fa, fb in zip(features(a), features(b)):
        table = np.stack([np.bincount(fa, minlength=V), np.bincount(fb, minlength=V)])
        table = table[:, table.sum(0) > 0]
        ps.append(chi2_contingency(table)[1])
    return min(ps)


def test_sampled_tokens_follow_the_targets_distribution(monkeypatch):
    """Speculation on (seeds 0..N) against off (other seeds): the same
    distribution at a 0.1% significance; a rule that waves the first
    proposal through fails the same test."""
    model = Llama.random_init(SMALL, seed=4)
    N = 1200
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "adaptive": False,
    }
    off, _ = _first_tokens(model, None, range(N, 2 * N))
    on, m = _first_tokens(model, spec, range(N))
    assert m["proposed"] > N, m
    p_ok = _homogeneous(off, on)
    assert p_ok > 1e-3, f"speculation changed the distribution (p = {p_ok:.2g})"

    def lenient(proposals, num_proposed, draws):  # the first proposal is never checked
        ok = (proposals == draws).at[:, 0].set(True)
        ok &= jnp.arange(proposals.shape[1])[None, :] < num_proposed[:, None]
        return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)

    bad, _ = _first_tokens(model, spec, range(N), monkeypatch, lenient)
    p_bad = _homogeneous(off, bad)
    assert p_bad < 1e-3, f"a biased acceptance rule went unnoticed (p = {p_bad:.2g})"


# ----------------------------------------------------------------- compiles


def test_after_warm_up_two_hundred_requests_with_speculation_compile_nothing(model):
    draft = Llama.random_init(dataclasses.replace(CFG, num_layers=1), seed=2)
    for spec, dm in (
        (NGRAM, None),
        (
            {"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "adaptive": False},
            draft,
        ),
    ):
        eng = LLMEngine(
            model,
            None,
            EngineConfig(
                num_pages=32,
                page_size=8,
                max_num_seqs=8,
                max_num_batched_tokens=32,
                speculative_config=spec,
            ),
            draft_model=dm,
        )
        rng = np.random.default_rng(9)
        prompts = _prompts(200, seed=3)
        with count_compiles() as compiles:
            for i in range(200):
                eng.add_request(prompts[i], _params(i))
                if i % 20 == 19:
                    for _ in range(int(rng.integers(1, 6))):
                        eng.step()
            eng.run_to_completion()
        assert eng.speculative_metrics()["steps"] > 0
        assert eng.scheduler.num_preemptions > 0
        assert compiles == [], f"{spec['method']}: {len(compiles)} XLA compiles after warm-up"


def test_gate_speculates_where_the_measured_costs_say_it_pays():
    from types import SimpleNamespace as NS

    from jaxkv.core.spec.decode import SpecGate

    gate = SpecGate(probe_every=3, smoothing=1.0)
    hit, miss = NS(spec_accepted=40, spec_proposed=40), NS(spec_accepted=0, spec_proposed=40)
    assert gate.allow([(miss, 4)], 1, "decode")  # nothing measured yet: try
    gate.observe("decode", False, 1, 0.040, 1)  # plain: 40 ms a token
    gate.observe("decode", True, 1, 0.080, 1, proposed=4, accepted=1)  # verify: 80 ms
    # 1 + 4 expected tokens (rate ~1) in 80 ms beat 1 in 40 ms; ~0.05 of one does not
    assert gate.allow([(hit, 4)], 1, "decode")
    assert [gate.allow([(miss, 4)], 1, "decode") for _ in range(4)] == [False] * 3 + [True]
    assert gate.alpha == 0.25
    gate.observe("decode", True, 1, float("nan"), 1, proposed=4, accepted=4)  # it compiled
    assert gate.seconds[("decode", True, 1)] == 0.080 and gate.alpha == 1.0
    # another sequence bucket has its own costs (unmeasured: try); a step with
    # prefill chunks goes by the decode-only costs and never explores
    assert not gate.allow([(hit, 4)], 16, "mixed")
    assert gate.allow([(miss, 4)], 16, "decode")
    assert gate.allow([(hit, 4)], 1, "mixed")
    # measured speculating only: a plain step next, so plain is measured too
    gate.observe("decode", True, 16, 0.300, 1, proposed=64, accepted=64)
    assert not gate.allow([(hit, 4)], 16, "decode")


def test_server_metrics_export_the_speculative_counters():
    from types import SimpleNamespace as NS

    from jaxkv.core.spec.decode import SpecStats
    from jaxkv.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics("tiny")
    stats = SpecStats(steps=3, drafts=5, proposed=17, accepted=9)
    eng = NS(
        scheduler=NS(running=[], waiting=[], num_preemptions=0),
        bm=NS(num_used_pages=0, num_pages=9, prefix_query_tokens=0, prefix_hit_tokens=0),
        spec=NS(stats=stats),
    )
    m.refresh(eng)
    stats.proposed, stats.accepted = 20, 11
    m.refresh(eng)  # counters move by the difference
    text = m.render().decode()
    for name, value in (("drafts", 5), ("draft_tokens", 20), ("accepted_tokens", 11)):
        assert f'jaxkv:spec_decode_num_{name}_total{{model_name="tiny"}} {value}.0' in text, name


TP_SCRIPT = """
import json, sys
import numpy as np
from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama
cfg = ModelConfig(architecture="llama", vocab_size=212, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=512, eos_token_ids=())
model = Llama.random_init(cfg, seed=1)
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(0, 212, 5)] * 4 for _ in range(8)]
spec = json.loads(sys.argv[2])
eng = LLMEngine(model, None, EngineConfig(warmup=False, num_pages=40, page_size=8, max_num_seqs=8,
                max_num_batched_tokens=64, tensor_parallel_size=int(sys.argv[1]),
                speculative_config=spec))
ids = [eng.add_request(p, SamplingParams(max_tokens=16, temperature=0.8 * (i % 2), seed=i))
       for i, p in enumerate(prompts)]
out = eng.run_to_completion()
print(json.dumps(dict(tokens=[out[i].outputs[0].token_ids for i in ids],
                      accepted=eng.speculative_metrics().get("accepted", 0))))
"""


def test_ngram_under_tensor_parallel_matches_one_device():
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")

    def run(tp, spec):
        out = subprocess.run(
            [sys.executable, "-c", TP_SCRIPT, str(tp), json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    one = run(1, None)
    two = run(2, dict(NGRAM, num_speculative_tokens=3))
    assert two["accepted"] > 0
    assert two["tokens"] == one["tokens"]
