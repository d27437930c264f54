"""Weight-only int8: the quantized matmul against numpy, and a small model's
logits against its float32 self and Hugging Face."""

import numpy as np
import jax.numpy as jnp

from checkpoints.safetensors_io import load_hf_dir
from jaxkv.model.llama import Llama
from jaxkv.model.quant import Dense, quantize_weight as quantize_int8
from tests.model_utils import Seq, hf_logits, make_hf_model, nan_cache, step_logits


def test_int8_dense_matches_numpy_dequantized_matmul():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 40)).astype(np.float32)
    w[:, 3] *= 50  # an outlier column gets its own scale
    x = rng.standard_normal((5, 48)).astype(np.float32)
    d = Dense(jnp.asarray(w), "int8")
    q, s = quantize_int8(w)
    assert np.asarray(q).dtype == np.int8 and np.abs(np.asarray(q)).max() == 127
    np.testing.assert_allclose(np.asarray(d(jnp.asarray(x))),
                               x @ (np.asarray(q, np.float32) * np.asarray(s)), rtol=1e-5, atol=1e-4)
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
    (got,), _ = step_logits(m8, nan_cache(cfg, 8, 8), [Seq(tokens, 0, [1, 2, 3, 4])], 8,
                            rows_per_seq=True)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert 0 < err < 0.03, err
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_w8a8_uses_int8_dots_for_large_steps_only():
    from scipy.linalg import hadamard

    rng = np.random.default_rng(2)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    d = Dense(jnp.asarray(w), "w8a8")
    small = rng.standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(d(jnp.asarray(small))), small @ w, rtol=1e-5, atol=1e-4)
    big = rng.standard_normal((16, 64)).astype(np.float32)
    big[:, 5] *= 50  # an outlier activation channel, as after RMSNorm in real models
    got = np.asarray(d(jnp.asarray(big)))
    # Oracle: rows rotated by the 64x64 Hadamard matrix, then int8 per row;
    # the weight rotated back and int8 per column.
    r = hadamard(64).astype(np.float32) / 8.0
    xr = big @ r
    xs = np.abs(xr).max(1, keepdims=True) / 127
    q, s = (np.asarray(a) for a in quantize_int8(r.T @ w))
    want = (np.round(xr / xs) @ q.astype(np.float32)) * xs * s
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    exact = big @ w
    err = np.abs(got - exact).max() / np.abs(exact).max()
    # Without the rotation the outlier channel eats the int8 range of a row.
    ps = np.abs(big).max(1, keepdims=True) / 127
    q0, s0 = (np.asarray(a) for a in quantize_int8(w))
    plain = (np.round(big / ps) @ q0.astype(np.float32)) * ps * s0
    err_plain = np.abs(plain - exact).max() / np.abs(exact).max()
    assert err < 0.02 and err < err_plain / 2, (err, err_plain)
