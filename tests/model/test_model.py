"""The jaxkv model against Hugging Face transformers on random small
configs, loaded through `checkpoints`, and the paged step against a plain
full-sequence forward (HF's)."""

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.safetensors_io import load_hf_dir
from jaxkv.model.llama import Llama
from tests.helpers.model_utils import Seq, hf_logits, make_hf_model, nan_cache, step_logits

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CONFIGS = {
    "llama-gqa-untied": ("llama", dict(num_key_value_heads=2)),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-mqa-bias": ("llama", dict(num_key_value_heads=1, attention_bias=True)),
    "llama3-rope-scaling": ("llama", dict(rope_scaling=LLAMA3_SCALING, rope_theta=500000.0)),
    "llama-linear-rope-scaling": (
        "llama",
        dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    ),
    "qwen2-gqa-bias-tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral-window": ("mistral", dict(num_key_value_heads=2, sliding_window=8)),
    # The families of one decoder configured per layer (issue 27).
    "qwen3-qk-norm": ("qwen3", dict(num_key_value_heads=2, head_dim=24)),
    "gemma2-caps-windows": (
        "gemma2",
        dict(num_key_value_heads=2, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    ),
    "gemma3-local-global": (
        "gemma3",
        dict(
            num_key_value_heads=1,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
}

PAGE = 8


def _close(got, want):
    scale = np.abs(want).max()
    err = np.abs(got - want).max()
    assert err <= 1e-4 * scale, f"max abs diff {err:.3g} > 1e-4 x logit scale {scale:.3g}"
    return err / scale


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    kind, over = CONFIGS[request.param]
    hf, path = make_hf_model(kind, tmp_path_factory.mktemp(request.param), **over)
    config, params = load_hf_dir(path)
    return hf, Llama.from_params(config, params), path


def test_logits_match_hf_every_position(pair):
    hf, model, _ = pair
    tokens = list(np.random.default_rng(1).integers(0, 128, 37))
    want = hf_logits(hf, tokens)
    cache = nan_cache(model.config, 16, PAGE)
    (got,), _ = step_logits(
        model, cache, [Seq(tokens, 0, [9, 3, 14, 6, 11])], PAGE, rows_per_seq=True
    )
    _close(got, want)


def test_chunked_prefill_then_decode_matches_hf(pair):
    hf, model, _ = pair
    tokens = list(np.random.default_rng(2).integers(0, 128, 30))
    want = hf_logits(hf, tokens)
    table = [7, 2, 12, 5]
    cache = nan_cache(model.config, 16, PAGE)
    pos = 0
    for chunk in (5, 1, 11):  # uneven chunks crossing page boundaries
        (got,), cache = step_logits(
            model, cache, [Seq(tokens[pos : pos + chunk], pos, table)], PAGE, rows_per_seq=True
        )
        _close(got, want[pos : pos + chunk])
        pos += chunk
    while pos < len(tokens):  # then one token at a time
        (got,), cache = step_logits(model, cache, [Seq(tokens[pos : pos + 1], pos, table)], PAGE)
        _close(got, want[pos])
        pos += 1


def test_mixed_step_matches_each_sequence_alone(pair):
    hf, model, _ = pair
    rng = np.random.default_rng(3)
    seqs = [list(rng.integers(0, 128, n)) for n in (19, 4, 26, 9)]
    alone = [hf_logits(hf, s) for s in seqs]
    tables = [[13, 4, 9], [2], [15, 1, 7, 10], [6, 12]]  # scrambled page order
    cache = nan_cache(model.config, 16, PAGE)
    # Step 1: prefill the prompts up to a cut; seq 1 is fully prefilled.
    cut = [12, 4, 17, 8]
    _, cache = step_logits(
        model, cache, [Seq(s[:c], 0, t) for s, c, t in zip(seqs, cut, tables)], PAGE
    )
    # Step 2: a mix of prefill chunks (seqs 0, 2) and single-token steps.
    step = [Seq(s[c : c + n], c, t) for s, c, t, n in zip(seqs, cut, tables, (7, 0, 9, 1)) if n]
    which = [0, 2, 3]
    got, _ = step_logits(model, cache, step, PAGE, rows_per_seq=True)
    for g, i in zip(got, which):
        n = len(g)
        _close(g, alone[i][cut[i] : cut[i] + n])


def test_bfloat16_model_close_to_float32(pair):
    hf, _, path = pair
    tokens = list(np.random.default_rng(4).integers(0, 128, 20))
    want = hf_logits(hf, tokens)
    cfg, params = load_hf_dir(path)
    m16 = Llama.from_params(cfg, params, dtype=jnp.bfloat16)
    cache = nan_cache(cfg, 16, PAGE, kv_dtype="bfloat16")
    (got,), _ = step_logits(m16, cache, [Seq(tokens, 0, [1, 2, 3])], PAGE, rows_per_seq=True)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 0.05, f"bfloat16 relative error {err:.3g}"
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8
