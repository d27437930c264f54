"""The real SmolLM2-135M-Instruct Q4_1 GGUF against transformers' own GGUF loader."""

import numpy as np
import pytest

from checkpoints.gguf_io import load_gguf
from jaxkv.model.params import expected_shapes

# With tests/core/test_smollm2_engine.py on one xdist worker: transformers' SmolLM2 load
# (the session fixture hf_smollm2) happens once.
pytestmark = pytest.mark.xdist_group("hf_smollm2")


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    return hf_smollm2


def test_config_matches_published(ours):
    """SmolLM2-135M-Instruct's published config.json values."""
    config, params, info = ours
    assert (
        config.architecture,
        config.vocab_size,
        config.hidden_size,
        config.intermediate_size,
    ) == ("llama", 49152, 576, 1536)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        30,
        9,
        3,
        64,
    )
    assert config.rope_theta == 100000.0 and config.rope_scaling is None
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings and "lm_head" not in params
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert config.max_position_embeddings == 8192
    assert info["tokenizer.ggml.model"] == "gpt2" and len(info["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.slow
def test_params_match_transformers(ours, hf_model):
    """Every tensor, through the HF -> jaxkv mapping, equals what transformers
    dequantizes (and un-permutes) from the same file; so does the config."""
    config, params, _ = ours
    hf = hf_model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (
        hf.vocab_size,
        hf.hidden_size,
        hf.intermediate_size,
        hf.num_hidden_layers,
    )
    assert (config.num_heads, config.num_kv_heads) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    E, H, K, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    want = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
    for i in range(config.num_layers):
        h, o = f"model.layers.{i}.", f"layers.{i}."
        want[o + "attn_norm"] = sd[h + "input_layernorm.weight"]
        want[o + "mlp_norm"] = sd[h + "post_attention_layernorm.weight"]
        want[o + "wq"] = sd[h + "self_attn.q_proj.weight"].reshape(H, D, E).transpose(2, 0, 1)
        want[o + "wk"] = sd[h + "self_attn.k_proj.weight"].reshape(K, D, E).transpose(2, 0, 1)
        want[o + "wv"] = sd[h + "self_attn.v_proj.weight"].reshape(K, D, E).transpose(2, 0, 1)
        want[o + "wo"] = sd[h + "self_attn.o_proj.weight"].reshape(E, H, D).transpose(1, 2, 0)
        want[o + "w_gate"] = sd[h + "mlp.gate_proj.weight"].T
        want[o + "w_up"] = sd[h + "mlp.up_proj.weight"].T
        want[o + "w_down"] = sd[h + "mlp.down_proj.weight"].T
    assert set(params) == set(want) == set(expected_shapes(config))
    for name, ref in want.items():
        np.testing.assert_allclose(params[name], ref, rtol=0, atol=1e-6, err_msg=name)
