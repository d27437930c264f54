"""Weight-only int8: the quantized matmul against numpy, and a small model's
logits against its float32 self and Hugging Face."""

import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.safetensors_io import load_hf_dir
from jaxkv.model.llama import Llama
from jaxkv.model.quant import Dense
from jaxkv.model.quant import quantize_weight as quantize_int8
from tests.helpers.model_utils import Seq, hf_logits, make_hf_model, nan_cache, step_logits


def test_int8_dense_matches_numpy_dequantized_matmul():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 40)).astype(np.float32)
    w[:, 3] *= 50  # an outlier column gets its own scale
    x = rng.standard_normal((5, 48)).astype(np.float32)
    d = Dense(jnp.asarray(w), "int8")
    q, s = quantize_int8(w)
    assert np.asarray(q).dtype == np.int8 and np.abs(np.asarray(q)).max() == 127
    np.testing.assert_allclose(
        np.asarray(d(jnp.asarray(x))),
        x @ (np.asarray(q, np.float32) * np.asarray(s)),
        rtol=1e-5,
        atol=1e-4,
    )
    # Quantization error per column stays within half a step of that column.
    err = np.abs(np.asarray(q, np.float32) * np.asarray(s) - w).max(axis=0)
    assert (err <= np.asarray(s) / 2 + 1e-6).all()


def test_int8_model_logits_close_to_hf(tmp_path):
    hf, path = make_hf_model("llama", tmp_path, num_key_value_heads=2)
    cfg, params = load_hf_dir(path)
    tokens = list(np.random.default_rng(1).integers(0, 128, 24))
    want = hf_logits(hf, tokens)
    m8 = Llama.from_params(cfg, params, quantize="int8")
    assert m8.layers[0].w_down.w[...].dtype == jnp.int8
    (got,), _ = step_logits(
        m8, nan_cache(cfg, 8, 8), [Seq(tokens, 0, [1, 2, 3, 4])], 8, rows_per_seq=True
    )
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err < 0.03, err
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def _w8a8_oracle(x, w):
    """Rows rotated by the 64x64 Hadamard matrix, then int8 per row; the
    weight rotated back and int8 per column (numpy)."""
    from scipy.linalg import hadamard

    r = hadamard(64).astype(np.float32) / 8.0
    xr = x @ r
    xs = np.abs(xr).max(1, keepdims=True) / 127
    q, s = (np.asarray(a) for a in quantize_int8(r.T @ w))
    return (np.round(xr / xs) @ q.astype(np.float32)) * xs * s


@pytest.mark.parametrize("rows", [1, 2, 3, 16])
def test_w8a8_uses_int8_dots_at_every_row_count(rows):
    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    d = Dense(jnp.asarray(w), "w8a8")
    assert not hasattr(d, "w") and d.w8[...].dtype == jnp.int8  # no float copy kept
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    x[:, 5] *= 50  # an outlier activation channel, as after RMSNorm in real models
    got = np.asarray(d(jnp.asarray(x)))
    assert got.shape == (rows, 32)
    np.testing.assert_allclose(got, _w8a8_oracle(x, w), rtol=1e-4, atol=1e-3)
    exact = x @ w
    err = np.abs(got - exact).max() / np.abs(exact).max()
    # Without the rotation the outlier channel eats the int8 range of a row.
    ps = np.abs(x).max(1, keepdims=True) / 127
    q0, s0 = (np.asarray(a) for a in quantize_int8(w))
    plain = (np.round(x / ps) @ q0.astype(np.float32)) * ps * s0
    err_plain = np.abs(plain - exact).max() / np.abs(exact).max()
    assert err < 0.02 and err < err_plain / 2, (err, err_plain)


@pytest.mark.parametrize("tied", [False, True])
def test_w8a8_model_logits_close_to_hf(tmp_path, tied):
    """w8a8 at one row (a decode, padded to two) and at many (a prefill),
    the head int8 too, tied or not."""
    hf, path = make_hf_model("llama", tmp_path, num_key_value_heads=2, tie_word_embeddings=tied)
    cfg, params = load_hf_dir(path)
    tokens = list(np.random.default_rng(1).integers(0, 128, 24))
    want = hf_logits(hf, tokens)
    m = Llama.from_params(cfg, params, quantize="w8a8")
    assert m.lm_head.w8[...].dtype == jnp.int8
    (got,), _ = step_logits(
        m, nan_cache(cfg, 8, 8), [Seq(tokens, 0, [1, 2, 3, 4])], 8, rows_per_seq=True
    )
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err < 0.05, err
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    # The last token alone, after the others are cached: a one-row step.
    m32 = Llama.from_params(cfg, params)
    last = {}
    for name, model in (("w8a8", m), ("float32", m32)):
        _, cache = step_logits(model, nan_cache(cfg, 8, 8), [Seq(tokens[:23], 0, [1, 2, 3])], 8)
        (last[name],), _ = step_logits(model, cache, [Seq(tokens[23:], 23, [1, 2, 3])], 8)
    assert np.abs(last["w8a8"] - want[23]).max() / np.abs(want).max() < 0.05
    assert np.abs(last["float32"] - want[23]).max() / np.abs(want).max() < 1e-4
    assert np.abs(last["w8a8"] - last["float32"]).max() > 1e-4  # not the float path
