"""The public entry: which implementation each (backend, platform,
pallas_target, interpret) request gets, the errors for requests a platform
cannot serve, and that on CPU the default is the reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels.ragged_paged_attention import reference, resolve
from tests.helpers import kernel_cases as kc


@pytest.mark.parametrize(
    "platform,request_kw,want",
    [
        ("cpu", {}, ("reference", None)),
        ("tpu", {}, ("tpu", False)),
        ("gpu", {}, ("gpu", False)),
        ("tpu", dict(backend="reference"), ("reference", None)),
        ("gpu", dict(backend="reference"), ("reference", None)),
        ("cpu", dict(backend="pallas"), ("tpu", True)),
        ("cpu", dict(backend="pallas", pallas_target="gpu"), ("gpu", True)),
        ("tpu", dict(backend="pallas"), ("tpu", False)),
        ("gpu", dict(backend="pallas", pallas_target="gpu"), ("gpu", False)),
        ("tpu", dict(backend="pallas", interpret=True), ("tpu", True)),
        ("gpu", dict(backend="pallas", pallas_target="mosaic_gpu"), ("mosaic_gpu", False)),
        ("gpu", dict(backend="pallas_mosaic_gpu"), ("mosaic_gpu", False)),
        ("cpu", dict(backend="pallas_mosaic_gpu"), ("mosaic_gpu", True)),
    ],
)
def test_resolve_picks_by_platform(platform, request_kw, want):
    assert resolve(platform=platform, **request_kw) == want


@pytest.mark.parametrize(
    "platform,request_kw,match",
    [
        (
            "gpu",
            dict(backend="pallas", pallas_target="tpu"),
            "TPU Pallas kernel cannot run on a gpu",
        ),
        (
            "tpu",
            dict(backend="pallas", pallas_target="gpu"),
            "GPU Pallas kernel cannot run on a tpu",
        ),
        ("cpu", dict(backend="pallas", interpret=False), "only in interpret mode"),
        ("cpu", dict(backend="triton"), "backend must be one of"),
        ("cpu", dict(backend="pallas", pallas_target="cuda"), "pallas_target must be one of"),
        ("tpu", dict(pallas_target="tpu"), "pallas_target applies to backend='pallas' only"),
        ("cpu", dict(interpret=True), "interpret applies to Pallas kernels only"),
        ("tpu", dict(backend="pallas_mosaic_gpu"), "MOSAIC_GPU Pallas kernel cannot run on a tpu"),
        ("gpu", dict(backend="pallas_mosaic_gpu", pallas_target="gpu"), "is pallas_target="),
        ("tpu", dict(backend="reference", interpret=True), "interpret applies to Pallas"),
    ],
)
def test_resolve_rejects_unsupported_requests(platform, request_kw, match):
    with pytest.raises(ValueError, match=match):
        resolve(platform=platform, **request_kw)


def _case():
    cfg = kc.DEFAULT_CONFIGS[0]
    (_, case, kw), _ = kc.config_batches(cfg)
    return case, {k: jnp.asarray(v) for k, v in case.items()}, kw


def _has_pallas_call(fn, args):
    return "pallas_call" in str(jax.make_jaxpr(lambda a: fn(**a))(args))


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="the CPU default is checked on a host whose JAX backend is the CPU",
)
def test_cpu_default_is_the_reference_with_the_native_kernel():
    """ "auto" on CPU: no Pallas; the native kernel where it is built (the
    reference's result within f32 tolerance), the pure reference otherwise;
    backend="reference" is always the pure jnp spec."""
    from pallas_kernels.ragged_paged_attention import cpu

    case, args, kw = _case()
    entry = lambda **a: pallas_kernels.ragged_paged_attention(**a, **kw)
    assert not _has_pallas_call(entry, args)
    assert _has_pallas_call(
        lambda **a: pallas_kernels.ragged_paged_attention(**a, **kw, backend="pallas"), args
    )
    jaxpr = lambda fn: str(jax.make_jaxpr(lambda a: fn(**a))(args))
    assert ("jaxkv_rpa_ragged" in jaxpr(entry)) == cpu.available()
    pure = lambda **a: pallas_kernels.ragged_paged_attention(**a, **kw, backend="reference")
    assert "jaxkv_rpa_ragged" not in jaxpr(pure)
    want = np.asarray(reference.ragged_paged_attention(**args, **kw))
    np.testing.assert_array_equal(np.asarray(pure(**args)), want)
    np.testing.assert_allclose(np.asarray(entry(**args)), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_pallas_on_cpu_runs_the_kernel_in_interpret_mode(target):
    case, args, kw = _case()
    options = dict(pages_per_block=4) if target == "tpu" else dict(decode_splits=3)
    got = pallas_kernels.ragged_paged_attention(
        **args, **kw, backend="pallas", pallas_target=target, kernel_options=options
    )
    np.testing.assert_allclose(np.asarray(got), kc.oracle(case, **kw), atol=3e-5, rtol=3e-5)


def test_kernel_options_need_a_kernel():
    _, args, kw = _case()
    with pytest.raises(ValueError, match="kernel_options apply to Pallas kernels only"):
        pallas_kernels.ragged_paged_attention(**args, **kw, kernel_options=dict(block_q=16))
