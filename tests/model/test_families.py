"""The one decoder configured per layer (issue 27): Hugging Face configs of
Qwen3, Gemma 2 and Gemma 3 (text and multimodal, transformers 5 and 4.x
forms) mapped into ModelConfig or refused by name; every per-layer feature
at once (local / global layers, RoPE bases, Gemma norms, q/k norms, soft
caps, learned sinks) against a float64 numpy forward; the engine's
preemption / chunking / prefix-cache invariance and tensor parallel 2 on
that model. Logits against transformers per family: tests/model/test_model.py."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from checkpoints.hf_config import from_hf_config
from jaxkv.config import EngineConfig
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.attention import ring_pages
from jaxkv.model.llama import Llama
from jaxkv.model.params import expected_shapes
from tests.helpers.model_utils import SMALL, Seq, nan_cache, small_engine, step_logits


# ------------------------------------------------------------------ configs
def _hf(cls_name: str, **kw) -> dict:
    import transformers as tf

    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return getattr(tf, cls_name)(**{**base, **kw}).to_dict()


def test_transformers_configs_map_into_the_families():
    q = from_hf_config(_hf("Qwen3Config"))
    assert (q.architecture, q.qk_norm, q.norm_offset, q.post_norms, q.windows) == (
        "qwen3",
        True,
        0.0,
        False,
        (None,) * 6,
    )
    g2 = from_hf_config(_hf("Gemma2Config", sliding_window=32))
    assert g2.architecture == "gemma2" and g2.windows == (32, None) * 3
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.hidden_act, g2.embed_scale) == (
        50.0,
        30.0,
        "gelu_tanh",
        True,
    )
    assert g2.sm_scale == 256**-0.5 and g2.tie_word_embeddings and g2.rope_local_theta is None
    g3 = from_hf_config(_hf("Gemma3TextConfig", sliding_window=64))
    assert g3.architecture == "gemma3" and g3.windows == (64,) * 5 + (None,)
    assert (g3.rope_theta, g3.rope_local_theta, g3.qk_norm, g3.post_norms, g3.norm_offset) == (
        1e6,
        1e4,
        True,
        True,
        1.0,
    )
    assert g3.attn_logit_softcap is None and g3.final_logit_softcap is None
    assert [g3.local_rope(i) for i in range(6)] == [True] * 5 + [False]
    assert g3.uniform_window is None  # mixed layers: no page is freed behind a window


def test_gemma3_multimodal_config_and_the_4x_form():
    import transformers as tf

    text = tf.Gemma3TextConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )
    mm = tf.Gemma3Config(text_config=text.to_dict()).to_dict()
    got = from_hf_config({**mm, "architectures": ["Gemma3ForConditionalGeneration"]})
    assert (
        got.architecture == "gemma3" and got.num_layers == 4 and got.windows == (16, 16, 16, None)
    )
    # 4.x wrote rope_theta, rope_local_base_freq, rope_scaling and the pattern.
    old = {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "rope_theta": 1e6,
        "rope_local_base_freq": 5e3,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 16,
    }
    got = from_hf_config(old)
    assert got.windows == ((512,) * 5 + (None,)) * 2 and got.rope_local_theta == 5e3
    assert got.rope_scaling.rope_type == "linear" and got.rope_scaling.factor == 8.0
    assert got.sm_scale == 0.25


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            {"model_type": "gemma4", "architectures": None},
            r"model_type: .*'gemma4'.*supported.*gemma3_text",
        ),
        ({"architectures": ["Gemma3nForCausalLM"]}, r"architectures: .*Gemma3n.*supported"),
        ({"hidden_activation": "relu"}, r"hidden_activation: unsupported .*relu"),
        ({"layer_types": ["sliding_attention"] * 5}, r"layer_types: must be a list of 6"),
        ({"layer_types": ["chunked_attention"] * 6}, r"layer_types"),
        (
            {"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
            r"rope_parameters\.sliding_attention: unsupported rope_type 'yarn'",
        ),
        ({"query_pre_attn_scalar": 0}, r"query_pre_attn_scalar: must be a positive"),
        ({"final_logit_softcapping": float("nan")}, r"final_logit_softcapping"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention"),
    ],
)
def test_unsupported_family_fields_are_refused_by_name(edit, match):
    cfg = {**_hf("Gemma3TextConfig"), **edit}
    with pytest.raises(ValueError, match=match):
        from_hf_config(cfg)


# ------------------------------------------------------------ numpy oracle
def _np_forward(cfg, p: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits [T, V] of the decoder in float64 numpy, written from the
    families' definitions (not from jaxkv's code)."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    T, D = len(tokens), cfg.head_dim

    def norm(x, w):
        return (
            x / np.sqrt((x * x).mean(-1, keepdims=True) + cfg.rms_norm_eps) * (cfg.norm_offset + w)
        )

    def rope(x, theta):  # x [T, N, D], halves paired
        ang = np.arange(T)[:, None] / theta ** (np.arange(0, D, 2) / D)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    def cap(x, c):
        return x if c is None else c * np.tanh(x / c)

    def gelu_tanh(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    x = p["embed"][tokens] * math.sqrt(cfg.hidden_size)
    rep = cfg.num_heads // cfg.num_kv_heads
    for i in range(cfg.num_layers):
        L = {k.split(".", 2)[2]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        h = norm(x, L["attn_norm"])
        q, k, v = (np.einsum("te,ehd->thd", h, L[w]) for w in ("wq", "wk", "wv"))
        q, k = norm(q, L["q_norm"]), norm(k, L["k_norm"])
        sliding = cfg.layer_types[i] == "sliding_attention"
        theta = cfg.rope_local_theta if sliding else cfg.rope_theta
        q, k = rope(q, theta), rope(k, theta)
        k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
        s = cap(
            np.einsum("thd,shd->hts", q, k) / math.sqrt(cfg.query_pre_attn_scalar),
            cfg.attn_logit_softcap,
        )
        t, j = np.arange(T)[:, None], np.arange(T)[None, :]
        live = (j <= t) & ((t - j < cfg.sliding_window) if sliding else True)
        s = np.where(live[None], s, -np.inf)
        sink = np.broadcast_to(L["sinks"][:, None, None], (cfg.num_heads, T, 1))
        full = np.concatenate([s, sink], -1)
        w = np.exp(full - full.max(-1, keepdims=True))
        w = (w / w.sum(-1, keepdims=True))[..., :-1]  # the sink takes mass, gives no value
        o = np.einsum("hts,shd->thd", w, v)
        x = x + norm(np.einsum("thd,hde->te", o, L["wo"]), L["post_attn_norm"])
        h = norm(x, L["mlp_norm"])
        m = (gelu_tanh(h @ L["w_gate"]) * (h @ L["w_up"])) @ L["w_down"]
        x = x + norm(m, L["post_mlp_norm"])
    return cap(norm(x, p["final_norm"]) @ p["embed"].T, cfg.final_logit_softcap)


def _random_params(cfg, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        scale = (
            0.3
            if name.endswith(("norm", "sinks"))
            else (1.0 if name == "embed" else 1 / math.sqrt(shape[0]))
        )
        out[name] = (
            scale * rng.standard_normal(shape) * (2 if name.endswith("sinks") else 1)
        ).astype(np.float32)
    return out


def test_every_per_layer_feature_matches_a_float64_forward():
    params = _random_params(SMALL)
    model = Llama.from_params(SMALL, params)
    tokens = list(np.random.default_rng(1).integers(0, SMALL.vocab_size, 29))
    want = _np_forward(SMALL, params, tokens)
    (got,), _ = step_logits(
        model, nan_cache(SMALL, 12, 8), [Seq(tokens, 0, [5, 2, 9, 7])], 8, rows_per_seq=True
    )
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-5, f"relative error {err:.3g}"
    # Each feature changes the logits, so a model that ignored one would fail.
    for off in (
        dict(attention_sinks=False),
        dict(rope_local_theta=None),
        dict(attn_logit_softcap=None),
        dict(layer_types=(), sliding_window=None),
    ):
        other = dataclasses.replace(SMALL, **off)
        p = {k: v for k, v in params.items() if k in expected_shapes(other)}
        (g,), _ = step_logits(
            Llama.from_params(other, p),
            nan_cache(other, 12, 8),
            [Seq(tokens, 0, [5, 2, 9, 7])],
            8,
            rows_per_seq=True,
        )
        assert np.abs(g - want).max() / np.abs(want).max() > 1e-3, off


# ------------------------------------------------------------------ engine
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def _prompts(n=24, seed=0):
    rng = np.random.default_rng(seed)
    prefixes = [list(map(int, rng.integers(0, 97, k))) for k in (24, 17)]
    return [
        (prefixes[i % 2] if i % 3 else [])
        + list(map(int, rng.integers(0, 97, int(rng.integers(1, 25)))))
        for i in range(n)
    ]


def test_engine_invariance_under_preemption_chunking_and_prefix_hits(small_model):
    # Without the hybrid pool: every page kept, so prefix hits happen.
    eng = small_engine(small_model, hybrid_kv_cache=False)
    prompts = _prompts()
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    final = eng.run_to_completion()
    assert eng.scheduler.num_preemptions > 0 and eng.bm.prefix_hit_tokens > 0
    assert eng.stats["partial_prefills"] > 0
    lone = small_engine(
        small_model, max_num_seqs=1, enable_prefix_caching=False, hybrid_kv_cache=False
    )
    for i, p in enumerate(prompts):
        rid = lone.add_request(p, GREEDY)
        assert (
            final[ids[i]].outputs[0].token_ids
            == lone.run_to_completion([rid])[rid].outputs[0].token_ids
        ), i


# ---------------------------------------------------------- hybrid KV pool
@pytest.mark.parametrize(
    "params, extra",
    [
        (SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), {}),
        (
            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
            dict(async_scheduling=True),
        ),
        (
            SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
            dict(num_pages=60),
        ),
        (
            SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
            dict(num_pages=60, async_scheduling=True),
        ),
        (
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
            dict(num_pages=60, speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
        ),
    ],
    ids=["greedy-preempted", "overlapped", "n3-forks", "n3-overlapped", "ngram-verify"],
)
def test_hybrid_pool_gives_the_tokens_of_a_run_without_it(small_model, params, extra):
    # The sliding layers keep only each sequence's window in its seat's ring
    # of pages; preemption, chunked prefill, forks (their rings copied) and
    # overlapped scheduling give the tokens of the engine that keeps every page.
    prompts = _prompts(16, seed=1)
    runs = {}
    for hybrid in (False, True):
        eng = small_engine(small_model, hybrid_kv_cache=hybrid, **extra)
        ids = [eng.add_request(p, params) for p in prompts]
        final = eng.run_to_completion()
        runs[hybrid] = [[c.token_ids for c in final[i].outputs] for i in ids]
        if hybrid:
            a = eng.attention
            assert a.local_layers == (0, 2) and a.ring_pages == ring_pages(8, 48, 8) == 8
            assert [x.shape[1] for x in eng.runner.cache.k] == [
                1 + 8 * 8,
                eng.cache_config.num_pages,
                1 + 8 * 8,
            ]
            if not extra:
                assert eng.scheduler.num_preemptions > 0 and eng.stats["partial_prefills"] > 0
    assert runs[True] == runs[False]


def test_hybrid_pool_of_a_gemma3_27b_shape_at_32k_holds_the_global_and_window_shares():
    from jaxkv.config import CacheConfig
    from jaxkv.model.kv_cache import cache_shapes
    from jaxkv.model.pool_sizing import hybrid_plan
    from tests.worker.test_sharding_compile import GEMMA3_27B

    ctx, ps = 32768, 16
    cfg = EngineConfig(max_num_seqs=1, max_num_batched_tokens=512, page_size=ps, warmup=False)
    local, ring, local_pages = hybrid_plan(cfg, GEMMA3_27B)
    assert len(local) == 52 and ring == ring_pages(1024, 512, ps) == 97  # 10 global layers

    def nbytes(cache):
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in cache.k + cache.v)

    today = nbytes(cache_shapes(GEMMA3_27B, CacheConfig(ctx // ps + 1, ps, "bfloat16")))
    hybrid = nbytes(
        cache_shapes(GEMMA3_27B, CacheConfig(ctx // ps + 1, ps, "bfloat16", local_pages))
    )
    shares = (
        10 / 62 + 52 / 62 * (1024 + 512 + 2 * ps) / ctx
    )  # global layers + each ring's window and chunk
    assert hybrid / today <= shares + 1e-3, (hybrid / today, shares)
    assert hybrid / today < 0.22  # 21.6% of today's bytes


def test_tensor_parallel_2_matches_one_device():
    from tests.helpers.sharding_worker import load, run
    from tests.helpers.workers import start_worker, worker_result

    oracle = run(load(None, family=True), 1, "reference", 6, 8)
    got = worker_result(
        start_worker(
            ["tp", "--tp", "2", "--family", "--max-tokens", "6", "--prompts", "8"], devices=2
        )
    )["2"]
    assert got["shards"] == 2 and got["tokens"] == oracle["tokens"]
    assert (
        got["params_bytes"] == got["planned"]["params"]
        and oracle["params_bytes"] == oracle["planned"]["params"]
    )


def test_gemma3_multimodal_checkpoint_loads_its_text_model_like_transformers(tmp_path):
    import torch
    import transformers as tf

    from checkpoints.safetensors_io import load_hf_dir

    torch.manual_seed(0)
    text = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    hf = tf.Gemma3ForConditionalGeneration(
        tf.Gemma3Config(
            text_config=text,
            vision_config=vision,
            mm_tokens_per_image=4,
            image_token_index=299,
            boi_token_index=297,
            eoi_token_index=298,
        )
    ).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    config, params = load_hf_dir(tmp_path)  # the vision tower and projector left out
    tokens = list(np.random.default_rng(1).integers(0, 296, 20))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens])).logits[0].numpy()
    (got,), _ = step_logits(
        Llama.from_params(config, params),
        nan_cache(config, 8, 8),
        [Seq(tokens, 0, [1, 2, 3])],
        8,
        rows_per_seq=True,
    )
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
