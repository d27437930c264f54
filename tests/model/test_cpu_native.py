"""The MKL sgemm custom call of the CPU path (`jaxkv.model.cpu_gemm`) against
numpy's float64 product and, inside the model, against Hugging Face logits;
when it is used and when XLA's dot stays; the switch that turns it off."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from checkpoints.safetensors_io import load_hf_dir
from jaxkv.model import cpu_gemm
from jaxkv.model.llama import Llama
from pallas_kernels import native
from tests.helpers.model_utils import Seq, hf_logits, make_hf_model, nan_cache, step_logits

needs_native = pytest.mark.skipif(
    not cpu_gemm.available(), reason=f"native CPU kernels: {native.unavailable('cpu_matmul')}"
)


@needs_native
@pytest.mark.parametrize("m,k,n", [(64, 576, 960), (65, 3, 7), (300, 1, 5), (128, 96, 1)])
def test_sgemm_matches_float64_product(m, k, n):
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    got = np.asarray(jax.jit(cpu_gemm.matmul)(x, w))
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_matmul_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32"):
        cpu_gemm.matmul(np.ones((64, 8), np.float16), np.ones((8, 4), np.float32))


@needs_native
def test_used_only_for_large_cpu_steps_on_one_device(monkeypatch):
    monkeypatch.setenv("JAXKV_CPU_PROJECTIONS", "blas")
    assert cpu_gemm.use_native(cpu_gemm.MIN_ROWS, None, None)
    assert cpu_gemm.use_native(4096, "cpu", None)
    assert not cpu_gemm.use_native(cpu_gemm.MIN_ROWS - 1, None, None)  # decode steps
    assert not cpu_gemm.use_native(512, "tpu", None)  # lowered for another platform
    assert not cpu_gemm.use_native(512, None, object())  # under a mesh (GSPMD)
    monkeypatch.setenv("JAXKV_CPU_PROJECTIONS", "xla")  # XLA's dot chosen
    assert not cpu_gemm.use_native(4096, "cpu", None)


@pytest.mark.parametrize(
    "vendor,want", [("GenuineIntel", "blas"), ("AuthenticAMD", "xla"), ("", "xla")]
)
def test_projection_gemm_is_chosen_per_cpu(vendor, want, monkeypatch):
    """MKL's sgemm leads XLA's dot on Intel's CPUs, XLA's leads on AMD's
    (`scripts/bench/blas.py`); JAXKV_CPU_PROJECTIONS overrides, a typo is
    named."""
    monkeypatch.setattr(native, "cpu_vendor", lambda: vendor)
    monkeypatch.delenv("JAXKV_CPU_PROJECTIONS", raising=False)
    assert cpu_gemm.projections() == want
    for forced in ("blas", "xla", "XLA"):
        monkeypatch.setenv("JAXKV_CPU_PROJECTIONS", forced)
        assert cpu_gemm.projections() == forced.lower()
    monkeypatch.setenv("JAXKV_CPU_PROJECTIONS", "mkl")
    with pytest.raises(ValueError, match="JAXKV_CPU_PROJECTIONS.*'mkl'"):
        cpu_gemm.projections()


@needs_native
@pytest.mark.parametrize(
    "kind,over",
    [
        ("llama", dict(num_key_value_heads=2)),
        ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    ],
)
def test_model_on_the_native_path_matches_hf(kind, over, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXKV_CPU_PROJECTIONS", "blas")  # the sgemm path on any CPU
    hf, path = make_hf_model(kind, tmp_path, **over)
    config, params = load_hf_dir(path)
    model = Llama.from_params(config, params)
    calls = []
    real = cpu_gemm.matmul
    monkeypatch.setattr(cpu_gemm, "matmul", lambda x, w: calls.append(x.shape) or real(x, w))
    tokens = list(np.random.default_rng(3).integers(0, 128, 150))
    cache = nan_cache(model.config, 24, 8)
    (got,), _ = step_logits(
        model, cache, [Seq(tokens, 0, list(range(3, 22)))], 8, rows_per_seq=True
    )
    assert len(calls) == 4 * config.num_layers  # wqkv, wo, gate/up, down of every layer
    want = hf_logits(hf, tokens)
    err = np.abs(got - want).max()
    assert err <= 1e-4 * np.abs(want).max(), err


def test_switched_off_by_the_environment():
    code = (
        "from jaxkv.model import cpu_gemm; from pallas_kernels import native; "
        "assert not cpu_gemm.available(); assert not cpu_gemm.use_native(4096, None, None); "
        "print(native.unavailable('cpu_matmul'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "JAXKV_NATIVE_CPU": "0"},
        check=True,
    )
    assert "JAXKV_NATIVE_CPU=0" in out.stdout


@needs_native
@pytest.mark.parametrize(
    "m,k,g,n,idle", [(40, 64, 8, 96, (0, 5)), (9, 16, 4, 300, ()), (64, 8, 3, 5, (0, 1, 2))]
)
def test_grouped_sgemm_matches_float64_per_group(m, k, g, n, idle):
    """Each group's rows times its weights, idle groups and the rows past
    the groups (zeros) included, against numpy float64."""
    rng = np.random.default_rng(m + g)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((g, k, n), dtype=np.float32)
    sizes = rng.multinomial(m - 3, np.ones(g) / g).astype(np.int32)
    for i in idle:  # their rows go to the next busy group
        sizes[(i + 1) % g] += sizes[i] if (i + 1) % g not in idle else 0
        sizes[i] = 0
    sizes = np.minimum(sizes, m)
    got = np.asarray(jax.jit(cpu_gemm.grouped_matmul)(x, w, sizes))
    want = np.zeros((m, n))
    start = np.concatenate([[0], np.cumsum(sizes)])
    for i in range(g):
        a, b = start[i], min(start[i + 1], m)
        want[a:b] = x[a:b].astype(np.float64) @ w[i].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))
    np.testing.assert_allclose(
        got, np.asarray(jax.lax.ragged_dot(x, w, sizes)), rtol=1e-5, atol=1e-4
    )
