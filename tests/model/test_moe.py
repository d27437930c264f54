"""Mixtures of experts (issue 28): Qwen3-MoE, Qwen2-MoE (shared
expert) and Mixtral configs mapped into ModelConfig or refused by name;
random small transformers models saved both ways transformers 5 writes
experts (per expert, and fused with save_original_format=False), loaded by
jaxkv's loader, their logits against transformers'; a skewed router and an
idle expert exact; the MoE block against a float64 numpy reference; the
engine's greedy tokens under preemption, chunked prefill and prefix hits
against transformers' generate; expert parallel (EP 2, EP 4, two
processes) and TP experts against one device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from checkpoints.hf_config import from_hf_config
from checkpoints.safetensors_io import hf_to_params, load_hf_dir, load_hf_tensors, read_hf_config
from jaxkv.model.llama import Llama
from jaxkv.model_config import ModelConfig
from tests.helpers.model_utils import Seq, hf_logits, nan_cache, step_logits

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.125,
    bos_token_id=None,
    eos_token_id=None,
)
FAMILIES = {  # 8 experts, top 2; a dense layer mixed in where the family has them
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "qwen2_moe": (
        "Qwen2Moe",
        dict(
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
        ),
    ),
    "mixtral": ("Mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
}


def _hf_config(family: str, **kw):
    import transformers as tf

    name, extra = FAMILIES[family]
    return getattr(tf, name + "Config")(**{**BASE, **extra, **kw})


def _hf_model(family: str, edit=None, **kw):
    """A random transformers model of `family` (eval, float32): norms away
    from 1, biases nonzero; `edit(model)` changes weights before use."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = _hf_config(family, **kw)
    cfg._attn_implementation = "eager"
    model = getattr(tf, FAMILIES[family][0] + "ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("bias"):
                p.normal_(0, 0.1)
        if edit is not None:
            edit(model)
    return model


def _saved(model, path, fused: bool = False):
    model.save_pretrained(path, save_original_format=not fused)
    return path


def _jaxkv_logits(config, params, tokens):
    (got,), _ = step_logits(
        Llama.from_params(config, params),
        nan_cache(config, 8, 8),
        [Seq(tokens, 0, [1, 2, 3, 4])],
        8,
        rows_per_seq=True,
    )
    return got


TOKENS = list(map(int, np.random.default_rng(1).integers(0, 256, 21)))


# ------------------------------------------------------------------ configs
def test_transformers_moe_configs_map_into_model_config():
    q3 = from_hf_config(
        _hf_config(
            "qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]
        ).to_dict()
    )
    assert (q3.architecture, q3.num_experts, q3.num_experts_per_tok, q3.moe_intermediate_size) == (
        "qwen3_moe",
        8,
        2,
        32,
    )
    assert (
        q3.sparse_layers == (False, True, False, False, False, True)
        and q3.qk_norm
        and q3.norm_topk_prob
    )
    assert q3.shared_expert_intermediate_size == 0 and not q3.attention_bias
    q2 = from_hf_config(_hf_config("qwen2_moe").to_dict())
    assert q2.sparse_layers == (False, True, True) and q2.shared_expert_intermediate_size == 48
    assert q2.attention_bias and not q2.norm_topk_prob and q2.sliding_window is None
    mx = from_hf_config(_hf_config("mixtral", sliding_window=16).to_dict())
    assert (mx.num_experts, mx.moe_intermediate_size, mx.norm_topk_prob, mx.sliding_window) == (
        8,
        96,
        True,
        16,
    )
    assert all(mx.layer_sparse(i) for i in range(3)) and mx.sparse_layers == ()
    assert ModelConfig.from_dict(q2.to_dict()) == q2 and ModelConfig.from_dict(q3.to_dict()) == q3
    dense = from_hf_config(_hf_config("qwen3_moe", mlp_only_layers=[0, 1, 2]).to_dict())
    assert not any(dense.layer_sparse(i) for i in range(3))


@pytest.mark.parametrize(
    "family, edit, match",
    [
        (
            "qwen3_moe",
            {"num_experts_per_tok": 9},
            r"num_experts_per_tok: must be in 1\.\.num_experts \(8\)",
        ),
        ("qwen3_moe", {"mlp_only_layers": "1"}, r"mlp_only_layers: must be a list"),
        ("qwen3_moe", {"moe_intermediate_size": 0}, r"moe_intermediate_size: must be a positive"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, r"decoder_sparse_step: must be a positive"),
        (
            "qwen2_moe",
            {"shared_expert_intermediate_size": None},
            r"shared_expert_intermediate_size: missing",
        ),
        ("mixtral", {"num_local_experts": None}, r"num_local_experts: missing"),
    ],
)
def test_bad_moe_config_fields_are_refused_by_name(family, edit, match):
    cfg = {**_hf_config(family).to_dict(), **edit}
    with pytest.raises(ValueError, match=match):
        from_hf_config(cfg)


def test_model_config_validates_the_moe_fields_by_name():
    good = from_hf_config(_hf_config("qwen3_moe").to_dict())
    for edit, match in (
        (dict(sparse_layers=(True,)), "sparse_layers: 1 entries for num_layers 3"),
        (dict(num_experts=0), "num_experts_per_tok: set without experts"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size: must be positive"),
        (dict(num_experts=-1), "num_experts: must be a non-negative integer"),
        (dict(sparse_layers=(1, 0, 1)), "sparse_layers: must be booleans"),
    ):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(good, **edit)
    with pytest.raises(
        ValueError, match="quantize: 'int8' is not supported for mixture-of-experts"
    ):
        Llama(good, lambda name, shape: np.zeros(shape, np.float32), "int8")


# ------------------------------------------------------- against transformers
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(family, fused, tmp_path):
    model = _hf_model(family)
    config, params = load_hf_dir(_saved(model, tmp_path, fused))
    assert config.architecture == family and params["layers.2.experts_gate_up"].shape == (
        8,
        64,
        2 * (96 if family == "mixtral" else 32),
    )
    want = hf_logits(model, TOKENS)
    got = _jaxkv_logits(config, params, TOKENS)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_missing_or_unknown_expert_tensors_are_named(tmp_path):
    _saved(_hf_model("qwen3_moe"), tmp_path)
    config = read_hf_config(tmp_path)
    tensors = load_hf_tensors(tmp_path)

    def load(ts):
        return hf_to_params(
            config, {n: t[1] for n, t in ts.items()}, {n: t[0] for n, t in ts.items()}
        )

    assert load(tensors)["layers.0.router"].shape == (64, 8)
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=rf"missing tensors: \['{gone}'\]"):
        load({n: t for n, t in tensors.items() if n != gone})
    extra = "model.layers.0.mlp.experts.8.down_proj.weight"
    with pytest.raises(ValueError, match=rf"unexpected tensors: \['{extra}'\]"):
        load({**tensors, extra: tensors["model.layers.0.mlp.experts.7.down_proj.weight"]})
    bad = "model.layers.0.mlp.experts.3.gate_proj.weight"
    with pytest.raises(ValueError, match=rf"{bad}: expected \(32, 64\), got \(64, 32\)"):
        load({**tensors, bad: ((64, 32), tensors[bad][1])})


@pytest.mark.parametrize("top_k", [1, 2])
def test_skewed_router_and_an_idle_expert_stay_exact(top_k, tmp_path):
    # Feature 0 of every embedding is large (the others of unit scale), so
    # the normed hidden state's feature 0 is large and positive at every
    # layer; the router's column 0 then sends every token to expert 3 first
    # and none to expert 6.
    import torch

    hot, idle = 3, 6

    def skew(model):
        model.model.embed_tokens.weight.mul_(8.0)
        model.model.embed_tokens.weight[:, 0] = 6.0
        for layer in model.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.gate.weight[:, 0] = 0.0
                layer.mlp.gate.weight[hot, 0], layer.mlp.gate.weight[idle, 0] = 5.0, -5.0

    model = _hf_model("qwen3_moe", edit=skew, num_experts_per_tok=top_k)
    with torch.no_grad():
        routers = model(torch.tensor([TOKENS]), output_router_logits=True).router_logits
    chosen = [torch.topk(r, top_k, dim=-1).indices.numpy() for r in routers]
    assert len(chosen) == 2 and all((c[:, 0] == hot).all() and (c != idle).all() for c in chosen)
    if top_k == 2:
        assert len(np.unique(np.concatenate([c[:, 1] for c in chosen]))) >= 3  # the rest spread out
    config, params = load_hf_dir(_saved(model, tmp_path))
    want = hf_logits(model, TOKENS)
    assert np.abs(_jaxkv_logits(config, params, TOKENS) - want).max() <= 1e-4 * np.abs(want).max()


# ---------------------------------------------------------- the block alone
def _np_moe(h, router, gate_up, down, k, norm, shared=None):
    """The MoE MLP in float64 numpy, token by token from the definition."""
    h, router, gate_up, down = (np.asarray(a, np.float64) for a in (h, router, gate_up, down))
    silu = lambda x: x / (1 + np.exp(-x))
    out = np.zeros_like(h)
    for t in range(len(h)):
        logits = h[t] @ router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:k]
        w = p[top] / p[top].sum() if norm else p[top]
        for e, we in zip(top, w):
            gu = h[t] @ gate_up[e]
            F = gu.shape[0] // 2
            out[t] += we * ((silu(gu[:F]) * gu[F:]) @ down[e])
        if shared is not None:
            sgu, sdown, sgate = (np.asarray(a, np.float64) for a in shared)
            F = sgu.shape[1] // 2
            g = h[t] @ sgu
            out[t] += (1 / (1 + np.exp(-(h[t] @ sgate)))) * ((silu(g[:F]) * g[F:]) @ sdown)
    return out


@pytest.mark.parametrize(
    "k, norm, with_shared, skew",
    [
        (2, True, False, False),
        (3, False, True, False),
        (1, False, False, True),
        (2, True, True, True),
    ],
)
@pytest.mark.parametrize("native", [False, True], ids=["ragged_dot", "mkl"])
def test_moe_block_matches_a_float64_reference(k, norm, with_shared, skew, native):
    """jax.lax.ragged_dot and the native CPU grouped sgemm (one per expert)
    against numpy float64, a skewed router and an idle expert included."""
    import jax
    import jax.numpy as jnp

    from jaxkv.model import cpu_gemm
    from jaxkv.model.moe import moe_mlp, route

    if native and not cpu_gemm.available():
        pytest.skip("the native CPU matmul library is not built here")

    rng = np.random.default_rng(k)
    T, E, X, F, Fs = 19, 16, 6, 12, 10
    f32 = lambda *s, scale=1.0: (scale * rng.standard_normal(s)).astype(np.float32)
    h, router = f32(T, E), f32(E, X, scale=0.5)
    if skew:  # every token's first choice expert 4, and expert 1 idle
        h[:, 0] = np.abs(h[:, 0]) + 3.0
        router[0] = 0.0
        router[0, 4], router[0, 1] = 4.0, -4.0
    gate_up, down = f32(X, E, 2 * F, scale=E**-0.5), f32(X, F, E, scale=F**-0.5)
    shared = (
        (f32(E, 2 * Fs, scale=E**-0.5), f32(Fs, E, scale=Fs**-0.5), f32(E)) if with_shared else None
    )
    fn = jax.jit(
        lambda h, r, gu, d, s: moe_mlp(
            h, r, gu, d, top_k=k, norm_topk_prob=norm, act=jax.nn.silu, shared=s, native=native
        )
    )
    assert ("jaxkv_grouped_sgemm" in fn.lower(h, router, gate_up, down, shared).as_text()) == native
    got = np.asarray(fn(h, router, gate_up, down, shared))
    want = _np_moe(h, router, gate_up, down, k, norm, shared)
    assert np.abs(got - want).max() <= 2e-6 * np.abs(want).max()
    _, experts = route(jnp.asarray(h), jnp.asarray(router), k, norm)
    if skew:
        assert (np.asarray(experts)[:, 0] == 4).all() and (np.asarray(experts) != 1).all()


# ------------------------------------------------------------------ engine
def test_engine_greedy_tokens_match_transformers_generate(tmp_path):
    import torch

    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine
    from jaxkv.core.sampling_params import SamplingParams

    model = _hf_model("qwen2_moe")  # shared expert, a dense layer, q/k/v biases
    config, params = load_hf_dir(_saved(model, tmp_path))
    rng = np.random.default_rng(2)
    prefixes = [list(map(int, rng.integers(0, 256, n))) for n in (19, 13)]
    prompts = [
        (prefixes[i % 2] if i % 3 else [])
        + list(map(int, rng.integers(0, 256, int(rng.integers(1, 14)))))
        for i in range(10)
    ]
    eng = LLMEngine(
        Llama.from_params(config, params),
        None,
        EngineConfig(
            warmup=False, num_pages=12, page_size=8, max_num_seqs=4, max_num_batched_tokens=32
        ),
    )
    ids = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0)) for p in prompts]
    final = eng.run_to_completion()
    assert eng.scheduler.num_preemptions > 0 and eng.bm.prefix_hit_tokens > 0
    assert eng.stats["partial_prefills"] > 0
    # transformers' generate on all prompts at once, left-padded (masked).
    n = max(map(len, prompts))
    inputs = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        want = model.generate(
            inputs, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    for i in range(len(prompts)):
        assert final[ids[i]].outputs[0].token_ids == want[i, n:].tolist(), i


def test_routed_counts_reach_metrics_as_transformers_routes(tmp_path):
    """The engine's tokens routed per expert (summed over layers) are the
    top-k of transformers' router logits over the rows the model ran, and
    /metrics' counter shows them, idle experts at 0."""
    import torch

    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine
    from jaxkv.core.sampling_params import SamplingParams
    from jaxkv.entrypoints.openai.metrics import ServerMetrics

    model = _hf_model("qwen3_moe")
    config, params = load_hf_dir(_saved(model, tmp_path))
    rng = np.random.default_rng(5)
    prompts = [list(map(int, rng.integers(0, 256, n))) for n in (11, 6)]
    eng = LLMEngine(
        Llama.from_params(config, params),
        None,
        EngineConfig(
            warmup=False, num_pages=16, page_size=8, max_num_seqs=4, max_num_batched_tokens=32
        ),
    )
    ids = [eng.add_request(p, SamplingParams(max_tokens=5, temperature=0.0)) for p in prompts]
    final = eng.run_to_completion(ids)
    want = np.zeros(8, np.int64)
    for p, i in zip(prompts, ids):  # rows run: the prompt and every output but the last
        run = torch.tensor([p + list(final[i].outputs[0].token_ids[:-1])])
        with torch.no_grad():
            logits = model(run, output_router_logits=True).router_logits
        for layer in logits:  # the sparse layers' [T, X]
            want += np.bincount(
                torch.topk(layer.float(), 2, dim=-1).indices.reshape(-1).numpy(), minlength=8
            )
    assert eng.runner.routed.tolist() == want.tolist()
    metrics = ServerMetrics("m")
    metrics.refresh(eng)
    text = metrics.render().decode()
    for x in range(8):
        assert (
            f'jaxkv:moe_routed_tokens_total{{expert="{x}",model_name="m"}} {float(want[x])}' in text
        )
    eng.shutdown()
