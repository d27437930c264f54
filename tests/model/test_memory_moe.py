"""The memory planner and `jaxkv estimate` on mixtures of experts (issue 28):
parameter counts against the arrays jaxkv builds and against transformers'
own models of random small Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss configs; the
bytes one device holds under tensor parallelism against a hand formula;
the published totals of real models' shapes."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from checkpoints.hf_config import from_hf_config
from jaxkv.config import ModelConfig
from jaxkv.model import memory
from jaxkv.model.params import expected_shapes

FAMILIES = {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral"}


def _hf_config(family: str, seed: int):
    """A random small transformers config of `family`: sizes, experts, top
    k, tied or not, and (Qwen) dense layers mixed in at random."""
    import transformers as tf

    r = np.random.default_rng([seed, list(FAMILIES).index(family)])
    heads, kv = [(4, 2), (4, 4), (8, 2), (6, 2), (4, 1)][r.integers(5)]  # KVH 1: replicated at t=2
    kw = {
        "vocab_size": int(r.integers(50, 300)),
        "hidden_size": int(r.choice([32, 33, 48, 64])),
        "intermediate_size": int(r.choice([16, 40, 64])),
        "num_hidden_layers": int(r.integers(2, 5)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": int(r.choice([8, 16])),
        "max_position_embeddings": 256,
        "tie_word_embeddings": bool(r.integers(2)),
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    X = int(r.integers(2, 9))
    k = int(r.integers(1, X + 1))
    if family == "mixtral":
        kw.update(num_local_experts=X, num_experts_per_tok=k)
    else:
        step = int(r.integers(1, 3))  # layer step - 1 stays sparse
        dense = [i for i in range(kw["num_hidden_layers"]) if i != step - 1 and r.integers(2)]
        kw.update(
            num_experts=X,
            num_experts_per_tok=k,
            moe_intermediate_size=int(r.choice([8, 24, 32])),
            decoder_sparse_step=step,
            norm_topk_prob=bool(r.integers(2)),
            mlp_only_layers=dense,
        )
    if family == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=int(r.choice([16, 48])))
    return getattr(tf, FAMILIES[family] + "Config")(**kw)


CASES = [(f, s) for f in FAMILIES for s in range(3)]


@pytest.mark.parametrize("family, seed", CASES)
def test_param_count_is_jaxkv_arrays_and_transformers_parameters(family, seed):
    """param_count equals the sizes of `Llama.random_init`'s parameters and
    the parameter count of transformers' model of the same config. Both
    leave out what is not a weight: the rotary frequencies (jaxkv an
    nnx.Variable, transformers a buffer); a tied head counts once in all
    three (transformers' parameters() yields the shared tensor once)."""
    import jax
    import torch
    import transformers as tf
    from flax import nnx

    from jaxkv.model.llama import Llama

    hf = _hf_config(family, seed)
    cfg = from_hf_config(hf.to_dict())
    assert cfg.num_experts and any(map(cfg.layer_sparse, range(cfg.num_layers)))
    ours = sum(
        x.size for x in jax.tree_util.tree_leaves(nnx.state(Llama.random_init(cfg), nnx.Param))
    )
    torch.manual_seed(0)
    theirs = sum(p.numel() for p in getattr(tf, FAMILIES[family] + "ForCausalLM")(hf).parameters())
    assert memory.param_count(cfg) == ours == theirs
    assert memory.param_count(cfg) == sum(math.prod(s) for s in expected_shapes(cfg).values())


def _hand_per_device(cfg: ModelConfig, t: int, b: int) -> float:
    """One device's weight bytes by the sharding table, tensor by tensor in
    float64: attention, dense MLPs, experts and shared experts 1/t; KV
    heads stored max(K, t); router, shared gate, norms, biases after the
    all-reduce whole; embed / lm_head 1/t when E / V divide; the rotary
    frequencies D/2 float32."""
    split = {
        "wq",
        "wk",
        "wv",
        "wo",
        "bq",
        "bk",
        "bv",
        "w_gate",
        "w_up",
        "w_down",
        "experts_gate_up",
        "experts_down",
        "shared_w_gate",
        "shared_w_up",
        "shared_w_down",
    }
    if cfg.hidden_size % t == 0:
        split.add("embed")
    if cfg.vocab_size % t == 0:
        split.add("lm_head")
    total = 0.0
    for name, shape in expected_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        n = float(math.prod(shape))
        if leaf in ("wk", "wv", "bk", "bv"):
            n = n / cfg.num_kv_heads * max(cfg.num_kv_heads, t)
        total += n * b / (t if leaf in split else 1)
    return total + cfg.head_dim / 2 * 4.0


@pytest.mark.parametrize("family, seed", CASES)
@pytest.mark.parametrize("tp", [1, 2])
def test_per_device_bytes_split_the_experts(family, seed, tp):
    cfg = from_hf_config(_hf_config(family, seed).to_dict())
    cfg = dataclasses.replace(
        cfg,
        moe_intermediate_size=2 * cfg.moe_intermediate_size,
        intermediate_size=2 * cfg.intermediate_size,
    )  # even, to split
    pd = memory.per_device_bytes(cfg, tp, "bfloat16", num_pages=3, page_size=4)
    assert pd["params"] == _hand_per_device(cfg, tp, 2)
    sparse = sum(map(cfg.layer_sparse, range(cfg.num_layers)))
    assert (
        pd["experts"]
        == sparse * cfg.num_experts * 3.0 * cfg.hidden_size * cfg.moe_intermediate_size * 2 / tp
    )
    if tp == 1:
        assert pd["params"] == memory.weight_bytes(cfg, "bfloat16") + cfg.head_dim // 2 * 4


def test_per_device_bytes_refuses_experts_that_cannot_split():
    cfg = from_hf_config(_hf_config("qwen3_moe", 0).to_dict())
    odd = dataclasses.replace(cfg, num_experts=3, num_experts_per_tok=1, moe_intermediate_size=9)
    with pytest.raises(ValueError, match="3 experts cannot be split"):
        memory.per_device_bytes(odd, 2)
    # Fm odd but the experts split whole (expert parallel): the same bytes per device.
    ep = dataclasses.replace(odd, num_experts=4)
    assert (
        memory.per_device_bytes(ep, 2)["experts"] * 2 == memory.per_device_bytes(ep, 1)["experts"]
    )


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json, the fields jaxkv reads
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
QWEN15_MOE_A27B = {  # Qwen/Qwen1.5-MoE-A2.7B (Qwen2-MoE: a shared expert, q/k/v biases)
    "architectures": ["Qwen2MoeForCausalLM"],
    "model_type": "qwen2_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "moe_intermediate_size": 1408,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "shared_expert_intermediate_size": 5632,
    "norm_topk_prob": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    "hf, total, active",
    [
        (QWEN3_30B_A3B, 30.5e9, 3.3e9),
        (QWEN15_MOE_A27B, 14.3e9, 2.7e9),
        (MIXTRAL_8X7B, 46.7e9, 12.9e9),
    ],
)
def test_published_totals_and_active_parameters(hf, total, active):
    """The model cards' figures (one decimal, in billions)."""
    cfg = from_hf_config(hf)
    assert abs(memory.param_count(cfg) - total) < 0.05e9
    assert abs(memory.active_param_count(cfg) - active) < 0.06e9


def test_estimate_of_qwen3_30b_a3b(tmp_path, capsys):
    """`jaxkv estimate` of Qwen3-30B-A3B's shape: the experts apart, in all
    and per device of 4; 30.5e9 parameters, 3.3e9 active; the KV budget
    beside one device's weights."""
    from jaxkv.entrypoints import cli

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    E, L, X, k, Fm, V = 2048, 48, 128, 8, 768, 151936
    experts = L * X * 3 * E * Fm
    attn = E * 32 * 128 * 2 + 2 * E * 4 * 128 + 2 * 128  # q, o, k, v, q/k norms
    rest = L * (attn + E * X + 2 * E) + 2 * V * E + E  # + router, norms; embed, lm_head, final norm
    active = rest + L * k * 3 * E * Fm
    assert round((experts + rest) / 1e9, 1) == 30.5 and abs(active - 3.3e9) < 0.06e9
    # Per device of 4: attention, experts, embed and lm_head split; norms, routers, frequencies whole.
    split = L * (attn - 2 * 128 + 3 * X * E * Fm) + 2 * V * E
    dev = split // 4 * 2 + (L * (E * X + 2 * E + 2 * 128) + E) * 2 + 64 * 4
    assert (
        cli.main(
            [
                "estimate",
                "--model",
                str(tmp_path),
                "--tensor-parallel-size",
                "4",
                "--context",
                "4096",
                "--memory",
                "80GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (
        f"| experts ({L} layers x {X}) | {experts:,} (28.99 B) | {2 * experts:,} (54.00 GiB) | "
        f"{experts // 2:,} (13.50 GiB) |" in out
    )
    assert (
        f"| total | {experts + rest:,} (30.53 B) | {2 * (experts + rest):,} (56.87 GiB) | {dev:,} "
        in out
    )
    assert f"Active per token: {active:,} parameters (3.35 B, 11.0%): 8 of 128 experts" in out
    page = 2 * L * (4 // 4) * 128 * 16 * 2  # one KV head per device
    assert f"beside {dev:,} bytes of weights" in out
    assert (
        f"- longest context at batch 1: {((80_000_000_000 - dev) // page - 1) * 16:,} tokens" in out
    )
    assert cli.main(["estimate", "--model", str(tmp_path), "--memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert (
        f"| total | {experts + rest:,} (30.53 B) | {2 * (experts + rest):,} (56.87 GiB) |\n" in out
    )
    assert f"beside {2 * (experts + rest):,} bytes of weights" in out


GPT_OSS_20B = {  # openai/gpt-oss-20b's config.json, the fields jaxkv reads
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "max_position_embeddings": 131072,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("seed", range(2))
def test_gpt_oss_param_count_is_jaxkv_arrays_and_transformers_parameters(seed):
    """gpt-oss: q/k/v/o biases, sinks, and per sparse layer the router's
    bias [X] and each expert's gate | up [2Fm] and down [E] biases."""
    import jax
    import torch
    import transformers as tf
    from flax import nnx

    from jaxkv.model.llama import Llama

    r = np.random.default_rng(seed)
    hf = tf.GptOssConfig(
        vocab_size=int(r.integers(50, 300)),
        hidden_size=int(r.choice([32, 48])),
        intermediate_size=int(r.choice([16, 24])),
        num_hidden_layers=int(r.integers(2, 4)),
        num_attention_heads=4,
        num_key_value_heads=int(r.choice([1, 2])),
        head_dim=8,
        num_local_experts=int(r.integers(2, 6)),
        num_experts_per_tok=1,
        sliding_window=8,
    )
    cfg = from_hf_config(hf.to_dict())
    ours = sum(
        x.size for x in jax.tree_util.tree_leaves(nnx.state(Llama.random_init(cfg), nnx.Param))
    )
    torch.manual_seed(0)
    theirs = sum(p.numel() for p in tf.GptOssForCausalLM(hf).parameters())
    assert (
        memory.param_count(cfg)
        == ours
        == theirs
        == sum(math.prod(s) for s in expected_shapes(cfg).values())
    )
    E, X, Fm, L = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_layers
    assert memory.mlp_params(cfg)["experts"] == L * X * (3 * E * Fm + 2 * Fm + E)
    # Two devices, tensor parallel: every expert's Fm (weights, gate | up bias) split, its down bias whole.
    even = dataclasses.replace(cfg, moe_intermediate_size=2 * Fm, intermediate_size=2 * Fm)
    assert memory.per_device_bytes(even, 2, "float32")["experts"] == 4 * L * X * (
        3 * E * Fm + 2 * Fm + E
    )
    # Expert parallel where Fm does not split: half the experts whole, biases with them.
    odd = dataclasses.replace(cfg, moe_intermediate_size=9, num_experts=4, num_experts_per_tok=1)
    assert memory.per_device_bytes(odd, 2, "float32")["experts"] * 2 == 4 * L * 4 * (
        3 * E * 9 + 2 * 9 + E
    )


def test_gpt_oss_20b_published_totals():
    """21B parameters (20.91e9), 3.6B active: the model card's active
    count leaves the embedding table out (the LM head in)."""
    cfg = from_hf_config(GPT_OSS_20B)
    assert abs(memory.param_count(cfg) - 20.91e9) < 0.01e9
    assert abs(memory.active_param_count(cfg) - cfg.vocab_size * cfg.hidden_size - 3.61e9) < 0.01e9
