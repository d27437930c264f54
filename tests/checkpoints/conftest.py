"""Tiny random Hugging Face models saved with transformers' own save_pretrained."""

from pathlib import Path

import numpy as np
import pytest

# name -> (transformers config class, config kwargs). Covers GQA, MQA, MHA,
# biases, tied embeddings and a head_dim that is not hidden / heads.
TINY_CONFIGS = {
    "llama": (
        "LlamaConfig",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            vocab_size=80,
            hidden_size=32,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        ),
    ),
    "mistral": (
        "MistralConfig",
        dict(
            vocab_size=72,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=12,
            tie_word_embeddings=False,
        ),
    ),
}


def make_tiny_model(name: str, seed: int = 0):
    """A transformers CausalLM for TINY_CONFIGS[name] with every parameter random
    (also the norms, so swapped tensors show)."""
    import torch
    import transformers

    cls_name, kwargs = TINY_CONFIGS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """name -> (saved dir, torch model); "llama_sharded" is the llama model saved
    in several shards with a model.safetensors.index.json."""
    out = {}
    root = tmp_path_factory.mktemp("tiny_hf")
    for name in TINY_CONFIGS:
        model = make_tiny_model(name)
        path = root / name
        model.save_pretrained(path)
        out[name] = (path, model)
    path = root / "llama_sharded"
    out["llama"][1].save_pretrained(path, max_shard_size="20KB")
    out["llama_sharded"] = (path, out["llama"][1])
    return out


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def copy_dir(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst
