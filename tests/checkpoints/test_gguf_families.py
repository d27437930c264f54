"""GGUF files of the families (Qwen3, Gemma 2, Gemma 3) as llama.cpp writes
them: a random small Hugging Face model is written to GGUF (llama.cpp's
tensor names, Gemma's norms stored as 1 + w, no q/k permutation), the file
is checked by transformers' own GGUF loader (its logits equal the source
model's), and jaxkv's load of it must give those logits too."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFWriter

from checkpoints import load_checkpoint
from checkpoints.gguf_io import GGUF_GEMMA_LAYER_MAP, GGUF_LAYER_MAP, GGUF_TOP_MAP
from jaxkv.model.llama import Llama
from tests.helpers.model_utils import Seq, hf_logits, make_hf_model, nan_cache, step_logits

CASES = {  # HF config overrides; Gemma at head_dim 256, the attention scale GGUF implies
    "qwen3": dict(
        num_attention_heads=2, num_key_value_heads=1, head_dim=128
    ),  # the head_dim GGUF implies to transformers
    "gemma2": dict(
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        tie_word_embeddings=True,
    ),
    "gemma3": dict(
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        tie_word_embeddings=True,
    ),  # five sliding layers to one global
}


def _write_gguf(hf, path, arch: str) -> None:
    cfg = hf.config
    gemma = arch.startswith("gemma")
    to_gguf = {hf_name: g for g, hf_name in GGUF_TOP_MAP.items()}
    layer = GGUF_GEMMA_LAYER_MAP if gemma else GGUF_LAYER_MAP
    for i in range(cfg.num_hidden_layers):
        to_gguf |= {f"model.layers.{i}.{hf_name}": f"blk.{i}.{g}" for g, hf_name in layer.items()}
    w = GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": cfg.num_key_value_heads,
        "attention.key_length": cfg.head_dim,
        "attention.value_length": cfg.head_dim,
    }.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(
        f"{arch}.rope.freq_base",
        cfg.rope_parameters.get("rope_theta")
        or cfg.rope_parameters["full_attention"]["rope_theta"],
    )
    if gemma:
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
    if arch == "gemma2":
        w.add_float32(f"{arch}.attn_logit_softcapping", cfg.attn_logit_softcapping)
        w.add_float32(f"{arch}.final_logit_softcapping", cfg.final_logit_softcapping)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg.vocab_size)])
    w.add_array("tokenizer.ggml.merges", [])
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = t.float().numpy()
        if gemma and name.endswith("norm.weight"):
            x = x + 1.0  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(to_gguf[name], np.ascontiguousarray(x, np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()


@pytest.mark.parametrize("arch", sorted(CASES))
def test_family_gguf_loads_like_transformers(tmp_path, arch):
    import torch
    from transformers import AutoModelForCausalLM

    hf, _ = make_hf_model(arch, tmp_path / "hf", **CASES[arch])
    gguf = tmp_path / "m.gguf"
    _write_gguf(hf, gguf, arch)
    tokens = list(np.random.default_rng(1).integers(0, 128, 23))
    want = hf_logits(hf, tokens)
    back = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    assert np.abs(hf_logits(back, tokens) - want).max() <= 1e-4 * np.abs(want).max(), "the file"
    config, params, _ = load_checkpoint(gguf)
    assert config.architecture == arch
    (got,), _ = step_logits(
        Llama.from_params(config, params),
        nan_cache(config, 8, 8),
        [Seq(tokens, 0, [3, 1, 2])],
        8,
        rows_per_seq=True,
    )
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
