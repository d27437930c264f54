"""gpt-oss: its config mapped into ModelConfig (YaRN RoPE, clamped SwiGLU,
router and expert biases, sinks, alternating windows) or refused by name;
YaRN's frequencies against transformers'; a random small transformers
model saved, loaded by jaxkv's loader, its logits against transformers';
the engine's greedy tokens under preemption, chunked prefill and prefix
hits against transformers' generate; the MXFP4 dequantizer against a
float64 decoding of the e2m1 bits, and an MXFP4 checkpoint loading to the
float model of its dequantized experts; tensor- and expert-parallel
splits (two CPU devices, a subprocess) against one device."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from checkpoints.hf_config import from_hf_config
from checkpoints.safetensors_io import load_hf_dir
from jaxkv.model_config import ModelConfig
from tests.helpers.model_utils import Seq, hf_logits, nan_cache, step_logits

ROPE = {
    "rope_type": "yarn",
    "factor": 4.0,
    "beta_fast": 8.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
    "rope_theta": 150000.0,
}
# swiglu_limit 1: the clamps bind on these weights' scale (7 would not).
BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=64,
    initializer_range=0.125,
    swiglu_limit=1.0,
    rope_parameters=ROPE,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
TOKENS = list(
    map(int, np.random.default_rng(1).integers(0, 256, 40))
)  # past the window and L0 = 16


def _hf_config(**kw):
    import transformers as tf

    return tf.GptOssConfig(**{**BASE, **kw})


def _hf_model(**kw):
    """A random transformers gpt-oss (eval, float32); norms off 1, biases and sinks that show."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = _hf_config(**kw)
    cfg._attn_implementation = "eager"
    model = tf.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    return model


def _jaxkv_logits(config, params, tokens):
    from jaxkv.model.llama import Llama

    (got,), _ = step_logits(
        Llama.from_params(config, params),
        nan_cache(config, 8, 8),
        [Seq(tokens, 0, [1, 2, 3, 4, 5, 6])],
        8,
        rows_per_seq=True,
    )
    return got


# ------------------------------------------------------------------ configs
def test_gpt_oss_config_maps_into_model_config():
    cfg = from_hf_config(_hf_config(num_hidden_layers=4).to_dict())
    assert (
        cfg.architecture,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
    ) == ("gpt_oss", 8, 2, 32)
    assert (
        cfg.moe_bias and cfg.norm_topk_prob and (cfg.swiglu_limit, cfg.swiglu_alpha) == (1.0, 1.702)
    )
    assert cfg.attention_bias and cfg.attention_out_bias and cfg.attention_sinks and not cfg.qk_norm
    assert cfg.windows == (8, None, 8, None) and cfg.rope_theta == 150000.0
    rs = cfg.rope_scaling
    assert (rs.rope_type, rs.factor, rs.beta_fast, rs.beta_slow, rs.truncate) == (
        "yarn",
        4.0,
        8.0,
        1.0,
        False,
    )
    assert rs.original_max_position_embeddings == 16 and rs.attention_factor == pytest.approx(
        0.1 * np.log(4) + 1
    )
    assert cfg.rope_scale(0) == rs.attention_factor
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    # A released config.json's layout: rope_scaling and rope_theta at the top, no layer_types.
    real = {
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
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "swiglu_limit": 7.0,
        "sliding_window": 128,
        "max_position_embeddings": 131072,
        "quantization_config": {"quant_method": "mxfp4"},
    }
    big = from_hf_config(real)
    assert big.windows[:3] == (128, None, 128) and big.attention_bias and big.swiglu_alpha == 1.702
    assert big.rope_scaling.factor == 32.0 and big.rope_scaling.attention_factor == pytest.approx(
        0.1 * np.log(32) + 1
    )


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"swiglu_limit": 0}, r"swiglu_limit: must be a positive"),
        ({"swiglu_alpha": "x"}, r"swiglu_alpha: must be a number"),
        ({"num_local_experts": None}, r"num_local_experts: missing"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok: must be in 1\.\.num_experts \(8\)"),
        (
            {"rope_parameters": {**ROPE, "factor": 0}},
            r"rope_parameters\.factor: must be a positive",
        ),
        (
            {"rope_parameters": {**ROPE, "beta_fast": "x"}},
            r"rope_parameters\.beta_fast: must be a number",
        ),
        (
            {"rope_parameters": {**ROPE, "truncate": "no"}},
            r"rope_parameters\.truncate: must be true or false",
        ),
        (
            {"rope_parameters": {**ROPE, "original_max_position_embeddings": None}},
            r"rope_parameters\.original_max_position_embeddings: missing",
        ),
        (
            {"rope_parameters": {**ROPE, "attention_factor": -1.0}},
            r"rope_parameters\.attention_factor: must be",
        ),
    ],
)
def test_bad_gpt_oss_fields_are_refused_by_name(edit, match):
    with pytest.raises(ValueError, match=match):
        from_hf_config({**_hf_config().to_dict(), **edit})


def test_model_config_refuses_bad_moe_bias_and_swiglu_fields():
    good = from_hf_config(_hf_config().to_dict())
    for edit, match in (
        (dict(moe_bias=1), "moe_bias: must be true or false"),
        (dict(swiglu_limit=-1.0), "swiglu_limit: must be a positive"),
        (
            dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0),
            "moe_bias: set without experts",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(good, **edit)


@pytest.mark.parametrize(
    "rope",
    [
        ROPE,
        {**ROPE, "truncate": True, "beta_fast": 32.0},
        {**ROPE, "mscale": 1.0, "mscale_all_dim": 0.5, "factor": 8.0},
    ],
    ids=["ramp", "truncated", "mscale"],
)
def test_yarn_frequencies_and_attention_factor_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxkv.model.layers import rope_frequencies

    hf = _hf_config(rope_parameters=dict(rope))
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = from_hf_config(hf.to_dict())
    np.testing.assert_allclose(rope_frequencies(cfg), inv.numpy(), rtol=1e-6)
    assert cfg.rope_scaling.attention_factor == pytest.approx(factor, rel=1e-12)
    plain = 1.0 / 150000.0 ** (np.arange(0, 16, 2) / 16)
    assert not np.allclose(rope_frequencies(cfg), plain, rtol=1e-3)  # the scaling shows here


# ------------------------------------------------------- against transformers
def test_logits_match_transformers_and_each_piece_matters(tmp_path):
    model = _hf_model()
    model.save_pretrained(tmp_path)
    config, params = load_hf_dir(tmp_path)
    assert params["layers.1.experts_gate_up"].shape == (8, 64, 64)
    assert params["layers.1.experts_gate_up_bias"].shape == (8, 64) and params[
        "layers.0.router_bias"
    ].shape == (8,)
    want = hf_logits(model, TOKENS)
    got = _jaxkv_logits(config, params, TOKENS)
    tol = 1e-5 * np.abs(want).max()
    assert np.abs(got - want).max() <= tol
    # Without the clamp, YaRN or the expert biases the logits move well past it.
    no_bias = {
        k: (np.zeros_like(v) if k.endswith("experts_down_bias") else v) for k, v in params.items()
    }
    for cfg, ps in (
        (dataclasses.replace(config, swiglu_limit=1e6), params),
        (dataclasses.replace(config, rope_scaling=None), params),
        (config, no_bias),
    ):
        assert np.abs(_jaxkv_logits(cfg, ps, TOKENS) - want).max() > 100 * tol


def test_engine_greedy_tokens_match_transformers_generate(tmp_path):
    import torch

    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine
    from jaxkv.core.sampling_params import SamplingParams
    from jaxkv.model.llama import Llama

    model = _hf_model()
    model.save_pretrained(tmp_path)
    config, params = load_hf_dir(tmp_path)
    rng = np.random.default_rng(2)
    prefixes = [list(map(int, rng.integers(0, 256, n))) for n in (19, 13)]
    prompts = [
        (prefixes[i % 2] if i % 3 else [])
        + list(map(int, rng.integers(0, 256, int(rng.integers(1, 14)))))
        for i in range(8)
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
    n = max(map(len, prompts))
    inputs = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        want = model.generate(
            inputs, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    for i in range(len(prompts)):
        assert final[ids[i]].outputs[0].token_ids == want[i, n:].tolist(), i


# ------------------------------------------------------------------- MXFP4
def _e2m1(code: int) -> float:
    """An FP4 e2m1 code's value from its bits: sign, 2 exponent bits (bias
    1; 0 subnormal), 1 mantissa bit."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def _np_dequantize(blocks, scales):
    """float64 [..., G * 32], value 2j of a group from byte j's low nibble."""
    table = np.array([_e2m1(c) for c in range(16)])
    lo, hi = table[blocks & 0x0F], table[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(blocks.shape[:-1] + (32,))
    return (vals * 2.0 ** (scales.astype(np.float64) - 127)[..., None]).reshape(
        blocks.shape[:-2] + (-1,)
    )


def _quantize(w):
    """w [..., N] (N % 32 == 0) -> (blocks [..., N/32, 16], scales [..., N/32])
    uint8: each group's exponent the least with |w| / 2**e <= 6, each value
    its nearest FP4 code."""
    g = w.reshape(w.shape[:-1] + (-1, 32)).astype(np.float64)
    e = np.ceil(np.log2(np.maximum(np.abs(g).max(-1), 1e-30) / 6.0))
    mags = np.array([_e2m1(c) for c in range(8)])
    codes = np.abs(np.abs(g / 2.0 ** e[..., None])[..., None] - mags).argmin(-1) + 8 * (g < 0)
    codes = codes.astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(
        e + 127, np.uint8
    )  # save_file writes raw buffers


def test_mxfp4_dequantizer_matches_a_float64_decoding_of_the_bits():
    from checkpoints.mxfp4 import FP4_E2M1, dequantize_mxfp4

    assert [_e2m1(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6] == list(FP4_E2M1[:8])
    assert list(FP4_E2M1[8:]) == [-v for v in FP4_E2M1[:8]] and np.signbit(FP4_E2M1[8])
    # By hand: byte 0x2F = low nibble 0xF (-6), high nibble 0x2 (1); scale 128: times 2.
    blocks = np.zeros((1, 16), np.uint8)
    blocks[0, :2] = [0x2F, 0x71]
    got = dequantize_mxfp4(blocks, np.array([128], np.uint8))  # one group: [32]
    assert got.dtype == np.float32 and got.shape == (32,)
    assert got[:4].tolist() == [-12.0, 2.0, 1.0, 12.0] and not got[4:].any()
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 5, 4), dtype=np.uint8)
    assert np.array_equal(dequantize_mxfp4(blocks, scales), _np_dequantize(blocks, scales))
    with pytest.raises(
        ValueError, match=r"mxfp4: blocks \(3, 5, 4, 16\) do not match scales \(3, 5\)"
    ):
        dequantize_mxfp4(blocks, scales[..., 0])


def test_an_mxfp4_checkpoint_loads_to_the_float_model_of_its_experts(tmp_path):
    """Experts quantized to MXFP4 (blocks and scales written as a released
    checkpoint holds them); transformers' model given the dequantized
    experts and saved as float: the two load to exactly the same params."""
    import torch
    from safetensors.numpy import load_file, save_file

    from checkpoints.mxfp4 import mxfp4_tensors

    model = _hf_model()
    quantized = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, proj)  # [X, in, out]
                w = p.numpy().transpose(0, 2, 1)  # stored [X, out, in]
                blocks, scales = _quantize(w)
                deq = _np_dequantize(blocks, scales)
                step = 2.0 ** (
                    scales.astype(np.float64) - 127
                )  # the widest FP4 gap's half, per group
                assert (
                    0 < np.abs(deq - w).max()
                    and (np.abs(deq - w).reshape(scales.shape + (32,)) <= step[..., None]).all()
                )
                p.copy_(torch.from_numpy(deq.transpose(0, 2, 1).astype(np.float32)))
                quantized[f"model.layers.{i}.mlp.experts.{proj}"] = (blocks, scales)
    model.save_pretrained(floats := tmp_path / "float")
    tensors = load_file(str(floats / "model.safetensors"))
    for name, (blocks, scales) in quantized.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    (mx := tmp_path / "mxfp4").mkdir()
    save_file(tensors, str(mx / "model.safetensors"))
    cfg = json.loads((floats / "config.json").read_text())
    (mx / "config.json").write_text(
        json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}})
    )
    config, params = load_hf_dir(mx)
    _, want_params = load_hf_dir(floats)
    assert params.keys() == want_params.keys() and all(
        np.array_equal(params[k], want_params[k]) for k in params
    )
    assert config == from_hf_config(
        cfg
    )  # so the logits are the float model's, as the logits test checks
    shapes = {n: (t.shape, None) for n, t in tensors.items()}
    gone = "model.layers.1.mlp.experts.down_proj_scales"
    with pytest.raises(
        ValueError, match="model.layers.1.mlp.experts.down_proj_blocks has no " + gone
    ):
        mxfp4_tensors({n: s for n, s in shapes.items() if n != gone})
    with pytest.raises(
        ValueError, match=gone + " has no model.layers.1.mlp.experts.down_proj_blocks"
    ):
        mxfp4_tensors({n: s for n, s in shapes.items() if n != gone.replace("_scales", "_blocks")})


# --------------------------------------------------------------- sharding
def test_tensor_and_expert_parallel_match_one_device():
    """Two CPU devices (a subprocess: XLA_FLAGS before jax starts): the
    experts split by their Fm (TP, the gate | up bias with its columns, the
    down bias added once) and whole (EP, the biases with their experts)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.model.test_gpt_oss"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(errs) == {"tp", "ep"} and all(e <= 1e-5 for e in errs.values()), errs


def _shard_main():
    from jaxkv.config import CacheConfig
    from jaxkv.model.attention import AttentionSpec
    from jaxkv.model.kv_cache import create_cache
    from jaxkv.model.llama import Llama
    from jaxkv.sharding import ShardingPlan, shard_model
    from jaxkv.worker.scoring import prefill_logits

    hf = {
        **BASE,
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": 2,
    }  # no transformers import
    cfg = from_hf_config(hf)
    model = Llama.random_init(cfg, seed=1)
    seqs = [(TOKENS, 0, [1, 2, 3, 4, 5])]
    (want,), _ = prefill_logits(
        model, seqs, create_cache(cfg, CacheConfig(num_pages=8, page_size=8))
    )
    errs = {}
    for name, ep in (("tp", False), ("ep", True)):
        plan = ShardingPlan.make(cfg, 2, expert_parallel=ep)
        cache = create_cache(
            plan.model_config(cfg), CacheConfig(num_pages=8, page_size=8), plan.cache_sharding()
        )
        (got,), _ = prefill_logits(
            shard_model(model, plan), seqs, cache, attention=AttentionSpec(mesh=plan.mesh)
        )
        errs[name] = float(np.abs(got - want).max() / np.abs(want).max())
    print(json.dumps(errs))


if __name__ == "__main__":
    _shard_main()
