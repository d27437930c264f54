"""The block matmul kernels (`pallas_kernels.block_matmul`) against a float64
product of the gguf library's own dequantization: the planes widen to the
library's values bit for bit; the TPU and GPU kernels run in interpret mode
on CPU for every format (odd row counts, N and K not multiples of the
tiles, several K blocks); the GPU kernel lowers for CUDA, the TPU kernel to
Mosaic and, with libtpu (`.ci/install_tpu_compiler.sh`), compiles deviceless
for v5e and v6e in a subprocess (as test_lowering.py does for attention).
Run as a module it prints one JSON line: {config id: "ok" | error}."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from pallas_kernels import block_matmul
from pallas_kernels.block_matmul import gpu, reference, tpu
from pallas_kernels.block_matmul import planes as planes_mod

REPO = Path(__file__).resolve().parents[2]
TYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q5_0": Q.Q5_0, "q8_0": Q.Q8_0}


def _weight(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Blocks of a random [n, k] weight, some scales made negative, tiny
    (float16 subnormals) or zero by hand, as files can hold."""
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32), TYPES[fmt]).copy()
    _, nbytes, _ = planes_mod.FORMATS[fmt]
    blocks = raw.reshape(n, k // 32, nbytes)
    d = blocks[..., :2].view(np.uint16)  # float16 bits of each block's scale
    pick = rng.random(d.shape[:2])
    d[pick < 0.1, 0] |= 0x8000  # negative
    d[(pick >= 0.1) & (pick < 0.15), 0] = rng.integers(
        1, 1024, int(((pick >= 0.1) & (pick < 0.15)).sum())
    )
    d[(pick >= 0.15) & (pick < 0.17), 0] = 0
    return raw


def _oracle(x: np.ndarray, raw: np.ndarray, fmt: str, n: int, k: int) -> np.ndarray:
    w = np.asarray(dequantize(raw, TYPES[fmt]), np.float64).reshape(n, k)
    return np.asarray(x, np.float64) @ w.T


def _close(got, want, x, w_abs, rtol):
    # error bound: rtol x the sum of |x| |w| per output
    bound = rtol * (np.abs(np.asarray(x, np.float64)) @ w_abs.T) + 1e-30
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), f"max error / bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("fmt", TYPES)
def test_planes_widen_to_the_gguf_values(fmt):
    n, k = 48, 96
    raw = _weight(fmt, n, k, seed=1)
    p = block_matmul.to_planes(raw, int(TYPES[fmt]), n, k)
    assert p.shape == (n, k)
    assert sum(a.nbytes for a in (p.q, p.d, p.m, p.qh) if a is not None) == raw.nbytes
    got = np.asarray(
        planes_mod.dequantize_tile(
            fmt, *(jnp.asarray(a) if a is not None else None for a in (p.q, p.d, p.m, p.qh))
        )
    )
    want = np.asarray(dequantize(raw, TYPES[fmt]), np.float32).reshape(n, k).T
    np.testing.assert_array_equal(got, want)


def test_wrong_blocks_are_refused_by_name():
    with pytest.raises(ValueError, match="q4_1: a \\[4, 64\\] weight needs 160 bytes"):
        block_matmul.to_planes(np.zeros(150, np.uint8), int(Q.Q4_1), 4, 64)
    with pytest.raises(ValueError, match="not GGUF type 12"):
        block_matmul.to_planes(np.zeros(144, np.uint8), int(Q.Q4_K), 1, 256)


# (T rows, N, K): decode-sized and prefill-sized rows; N whole when not a
# multiple of 128 (TPU) or a power-of-two tile (GPU); K whole or 512-blocks.
SHAPES = [(1, 192, 576), (20, 256, 1024), (70, 576, 64)]


@pytest.mark.parametrize("fmt", TYPES)
@pytest.mark.parametrize("kernel", ["tpu", "gpu", "reference"])
def test_kernels_match_float64_oracle(kernel, fmt):
    run = {
        "tpu": lambda x, p: tpu.matmul(x, p, interpret=True),
        "gpu": lambda x, p: gpu.matmul(x, p, interpret=True),
        "reference": reference.matmul,
    }[kernel]
    for i, (t, n, k) in enumerate(SHAPES):
        raw = _weight(fmt, n, k, seed=i)
        p = jax.tree.map(jnp.asarray, block_matmul.to_planes(raw, fmt, n, k))
        x = np.random.default_rng(10 + i).standard_normal((t, k)).astype(np.float32)
        w_abs = np.abs(np.asarray(dequantize(raw, TYPES[fmt]), np.float64).reshape(n, k))
        want = _oracle(x, raw, fmt, n, k)
        got = run(jnp.asarray(x), p)
        assert got.shape == (t, n) and got.dtype == jnp.float32
        _close(got, want, x, w_abs, rtol=2e-6)
        if kernel != "reference" and i == 1:  # bfloat16 activations: the tile rounded too
            xb = jnp.asarray(x, jnp.bfloat16)
            _close(
                run(xb, p), _oracle(np.asarray(xb, np.float32), raw, fmt, n, k), x, w_abs, rtol=1e-2
            )


def test_matmul_dispatches_by_backend():
    raw = _weight("q4_1", 100, 64)  # N = 100: no power-of-two tile -> the XLA path on GPU
    p = jax.tree.map(jnp.asarray, block_matmul.to_planes(raw, "q4_1", 100, 64))
    x = jnp.ones((3, 64), jnp.float32)
    assert not gpu.tiles(3, p) and tpu.tiles(3, p)
    want = _oracle(np.ones((3, 64)), raw, "q4_1", 100, 64)
    for backend in ("gpu", "tpu", "cpu"):
        got = block_matmul.matmul(x, p, backend=backend, interpret=True)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_a_model_on_pallas_blocks_gives_the_float32_models_tokens(tmp_path, monkeypatch, backend):
    # The TPU / GPU path of jaxkv.model.blocks, its kernels in interpret
    # mode: a GGUF whose layers mix types (q F16, k Q8_0, v Q4_0, o Q4_1,
    # gate BF16, up Q5_0, down Q5_1) loads with the four 32-value types as
    # planes, and decodes the tokens of the same model on float32 weights.
    from checkpoints.loader import load_model
    from jaxkv.config import EngineConfig
    from jaxkv.model import blocks
    from tests.checkpoints.test_gguf_io import write_gguf
    from tests.helpers.model_utils import greedy_runs

    monkeypatch.setattr(blocks, "backend", lambda: backend)
    monkeypatch.setattr(blocks, "INTERPRET", True)
    # The step still runs on this CPU, so the tied Q8_0 head takes the native
    # matmul; keep it exact (no int8 rounding of h) to compare the kernels.
    monkeypatch.setenv("JAXKV_GGUF_ROUND_X", "0")
    assert blocks.keep_gguf_blocks(EngineConfig(gguf_blocks=True, dtype="bfloat16"))
    path = tmp_path / "mixed.gguf"
    write_gguf(path, arch="llama", tied=True)
    prompts = [[1, 5, 9, 2], list(range(3, 30))]
    runs = {}
    for keep in (True, False):
        module, tok = load_model(str(path), gguf_blocks=keep)
        if keep:
            attn, layer = module.layers[0].attn, module.layers[0]
            assert (attn.wqkv.kinds, attn.wo.kinds, layer.w_gate_up.kinds) == (
                (0, -int(Q.Q8_0), -int(Q.Q4_0)),
                (-int(Q.Q4_1),),
                (0, -int(Q.Q5_0)),
            )
        runs[keep] = greedy_runs(module, tok, prompts)
    for (tb, lb), (tf, lf) in zip(runs[True], runs[False]):
        assert tb == tf
        np.testing.assert_allclose(lb, lf, atol=1e-3)


# Deviceless / lowering configs: (id, fmt, T, N, K, x dtype)
LOWER = [
    ("q4_1-t16-n576-k576-f32", "q4_1", 16, 576, 576, "float32"),
    ("q8_0-t1-n49152-k576-f32", "q8_0", 1, 49152, 576, "float32"),
    ("q4_0-t256-n1536-k2048-bf16", "q4_0", 256, 1536, 2048, "bfloat16"),
    ("q5_0-t32-n640-k1024-bf16", "q5_0", 32, 640, 1024, "bfloat16"),
]


def _specs(fmt, t, n, k, dtype, sharding=None):
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sharding)
    g = k // 32
    q = sds((k, n), "int8") if fmt == "q8_0" else sds((k // 2, n), "uint8")
    p = planes_mod.Planes(
        q=q,
        d=sds((g, n), "uint16"),
        m=sds((g, n), "uint16") if fmt == "q4_1" else None,
        qh=sds((g, n), "int32") if fmt == "q5_0" else None,
        fmt=fmt,
    )
    return sds((t, k), dtype), p


@pytest.mark.parametrize("config", LOWER, ids=lambda c: c[0])
def test_gpu_kernel_lowers_for_cuda(config):
    _, fmt, t, n, k, dtype = config
    device = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"
    )
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    ):
        text = (
            jax.jit(gpu.matmul)
            .trace(*_specs(fmt, t, n, k, dtype))
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("config", LOWER, ids=lambda c: c[0])
def test_tpu_kernel_lowers_to_mosaic(config):
    _, fmt, t, n, k, dtype = config
    device = jax.sharding.AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    ):
        text = (
            jax.jit(tpu.matmul)
            .trace(*_specs(fmt, t, n, k, dtype))
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
    assert "tpu_custom_call" in text


def compile_for_topology(topology):
    """{config id: "ok" | error} for the TPU kernel compiled for `topology`."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, SingleDeviceSharding

    device = topologies.get_topology_desc(topology, "tpu").devices[0]
    results = {}
    with jax.set_mesh(Mesh(np.array([device]), ("x",))):
        for cid, fmt, t, n, k, dtype in LOWER:
            try:
                specs = _specs(fmt, t, n, k, dtype, SingleDeviceSharding(device))
                text = jax.jit(tpu.matmul).trace(*specs).lower().compile().as_text()
                results[cid] = "ok" if "tpu_custom_call" in text else "no Mosaic kernel in HLO"
            except Exception as e:  # reported per config by the test
                results[cid] = f"{type(e).__name__}: {e}"[:2000]
    return results


def test_tpu_kernel_compiles_deviceless():
    compiler = Path(os.environ.get("JAXKV_TPU_COMPILER", REPO / ".tpu-compiler"))
    if not (compiler / "libtpu").is_dir():
        pytest.skip(f"libtpu is not in {compiler} (bash .ci/install_tpu_compiler.sh installs it)")
    env = dict(
        os.environ,
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        PYTHONPATH=os.pathsep.join([str(REPO), str(compiler)]),
    )
    results = {}
    for topology in ("v5e:2x2", "v6e:2x2"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.pallas_kernels.test_block_matmul",
                "--topology",
                topology,
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        assert proc.returncode == 0 and lines, (
            f"TPU compile subprocess failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"{proc.stderr[-3000:]}"
        )
        results[topology] = json.loads(lines[-1])
    failed = {(tp, cid): r for tp, res in results.items() for cid, r in res.items() if r != "ok"}
    assert not failed and all(len(r) == len(LOWER) for r in results.values()), failed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--topology", required=True)
    print(json.dumps(compile_for_topology(parser.parse_args().topology)), flush=True)
