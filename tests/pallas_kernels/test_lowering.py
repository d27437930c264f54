"""The kernels build for real hardware without it: the TPU kernel is
compiled (Mosaic included) deviceless for v5e and v6e against libtpu's
topology descriptions, and lowered to Mosaic MLIR; the GPU kernel is lowered
for CUDA (Triton IR inside XLA custom calls).

The TPU compile runs in a subprocess, the only process that sees libtpu: it
lives in .tpu-compiler/ (`.ci/install_tpu_compiler.sh`), outside the
environment, because an importable libtpu makes every JAX process on a
machine without a TPU probe for one. libtpu also takes a machine-wide
lockfile when a process initializes it (another test's subprocess may hold
it), so ALLOW_MULTIPLE_LIBTPU_LOAD=1 is set.
Run as a module it prints one JSON line: {config id: "ok" | error}.
"""

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

from pallas_kernels.ragged_paged_attention import gpu, tpu

REPO = Path(__file__).resolve().parents[2]
TOPOLOGIES = ("v5e:2x2", "v6e:2x2")

# (id, q dtype, pages format, head_dim, page_size, H, KVH, attention kwargs):
# the format a float dtype (pages of it), "int8", "int4" or an fp8 dtype
# (`kv_formats`); sinks=True passes learned attention sinks, float32 [H].
CONFIGS = [
    ("bf16-d128-p16-h32kv8", "bfloat16", "bfloat16", 128, 16, 32, 8, {}),
    ("bf16-d64-p8-h8kv1", "bfloat16", "bfloat16", 64, 8, 8, 1, {}),
    (
        "f32-d64-p8-h6kv2-win-cap",
        "float32",
        "float32",
        64,
        8,
        6,
        2,
        dict(sliding_window=64, soft_cap=30.0),
    ),
    ("bf16-int8-d128-p32-h24kv8", "bfloat16", "int8", 128, 32, 24, 8, {}),
    ("f32-int8-d128-p16-h4kv4", "float32", "int8", 128, 16, 4, 4, {}),
    (
        "bf16-d128-p16-h16kv2-win-sinks",
        "bfloat16",
        "bfloat16",
        128,
        16,
        16,
        2,
        dict(sliding_window=128, sinks=True),
    ),
    (
        "f32-int8-d64-p8-h8kv1-cap-sinks",
        "float32",
        "int8",
        64,
        8,
        8,
        1,
        dict(soft_cap=30.0, sinks=True),
    ),
    ("bf16-int4-d128-p16-h32kv8", "bfloat16", "int4", 128, 16, 32, 8, {}),
    (
        "f32-int4-d64-p8-h8kv1-win-cap-sinks",
        "float32",
        "int4",
        64,
        8,
        8,
        1,
        dict(sliding_window=64, soft_cap=30.0, sinks=True),
    ),
    ("bf16-fp8e4m3-d128-p16-h16kv2", "bfloat16", "float8_e4m3fn", 128, 16, 16, 2, {}),
    (
        "bf16-fp8e5m2-d64-p32-h8kv1-win",
        "bfloat16",
        "float8_e5m2",
        64,
        32,
        8,
        1,
        dict(sliding_window=128),
    ),
    (
        "f32-fp8e4m3-d128-p8-h4kv4-cap",
        "float32",
        "float8_e4m3fn",
        128,
        8,
        4,
        4,
        dict(soft_cap=30.0),
    ),
]
NUM_TOKENS, NUM_SEQS, PAGES_PER_SEQ, NUM_PAGES = 64, 8, 32, 300


def _specs(
    q_dtype, kv_dtype, head_dim, page_size, num_heads, num_kv_heads, sharding=None, sinks=False
):
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    # int4: two channels a byte, uint8 [.., D // 2], with bfloat16 scales.
    int4 = kv_dtype == "int4"
    pages = sds(
        (num_kv_heads, NUM_PAGES, page_size, head_dim // 2 if int4 else head_dim),
        "uint8" if int4 else kv_dtype,
    )
    specs = [
        sds((NUM_TOKENS, num_heads, head_dim), q_dtype),
        pages,
        pages,
        sds((NUM_SEQS,), "int32"),
        sds((NUM_SEQS, PAGES_PER_SEQ), "int32"),
        sds((NUM_SEQS + 1,), "int32"),
        sds((), "int32"),
    ]
    if kv_dtype in ("int8", "int4"):
        specs += [sds((num_kv_heads, NUM_PAGES, page_size), "bfloat16" if int4 else "float32")] * 2
    if sinks:
        specs.append(sds((num_heads,), "float32"))
    return specs


def _fn(kernel, head_dim, kw):
    kw = dict(kw)
    with_sinks = kw.pop("sinks", False)

    def f(q, k, v, kv_lens, block_tables, cu_q_lens, num_seqs, *extra):
        extra = list(extra)
        extra_kw = dict(sinks=extra.pop()) if with_sinks else {}
        if extra:
            extra_kw.update(k_scale=extra[0], v_scale=extra[1])
        return kernel.ragged_paged_attention(
            q,
            k,
            v,
            kv_lens,
            block_tables,
            cu_q_lens,
            num_seqs,
            sm_scale=head_dim**-0.5,
            **kw,
            **extra_kw,
        )

    return f


def compile_for_topology(topology):
    """{config id: "ok" | error} for the TPU kernel compiled for `topology`."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, SingleDeviceSharding

    topo = topologies.get_topology_desc(topology, "tpu")
    device = topo.devices[0]
    results = {}
    # Mosaic lowering reads the chip generation from the ambient mesh's device.
    with jax.set_mesh(Mesh(np.array([device]), ("x",))):
        for cid, q_dt, kv_dt, d, ps, h, kvh, kw in CONFIGS:
            try:
                specs = _specs(
                    q_dt,
                    kv_dt,
                    d,
                    ps,
                    h,
                    kvh,
                    SingleDeviceSharding(device),
                    sinks=kw.get("sinks", False),
                )
                compiled = jax.jit(_fn(tpu, d, kw)).trace(*specs).lower().compile()
                text = compiled.as_text()
                results[cid] = "ok" if "tpu_custom_call" in text else "no Mosaic kernel in HLO"
            except Exception as e:  # reported per config by the test
                results[cid] = f"{type(e).__name__}: {e}"[:2000]
    return results


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_tpu_kernel_compiles_deviceless(topology):
    # One subprocess per topology compiles every config (one test, so parallel
    # workers never compile the same topology twice).
    compiler = Path(os.environ.get("JAXKV_TPU_COMPILER", REPO / ".tpu-compiler"))
    if not (compiler / "libtpu").is_dir():
        pytest.skip(
            f"libtpu is not in {compiler}, so the TPU kernel cannot be compiled "
            "deviceless (bash .ci/install_tpu_compiler.sh installs it there)"
        )
    env = dict(
        os.environ,
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        PYTHONPATH=os.pathsep.join([str(REPO), str(compiler)]),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.pallas_kernels.test_lowering", "--topology", topology],
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
    results = json.loads(lines[-1])
    assert set(results) == {c[0] for c in CONFIGS}
    failed = {cid: r for cid, r in results.items() if r != "ok"}
    assert not failed, f"TPU kernel failed to compile for {topology}: {failed}"


@pytest.mark.parametrize("config", CONFIGS[:3], ids=lambda c: c[0])
def test_tpu_kernel_lowers_to_mosaic(config):
    # Needs no libtpu: Pallas -> Mosaic MLIR, the step before compile. Some
    # lowering rules read the chip generation from the ambient mesh's device.
    cid, q_dt, kv_dt, d, ps, h, kvh, kw = config
    device = jax.sharding.AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        text = (
            jax.jit(_fn(tpu, d, kw))
            .trace(*_specs(q_dt, kv_dt, d, ps, h, kvh, sinks=kw.get("sinks", False)))
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c[0])
def test_gpu_kernel_lowers_for_cuda(config):
    cid, q_dt, kv_dt, d, ps, h, kvh, kw = config
    # Newer jax reads the target GPU from the ambient mesh's device.
    device = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"
    )
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    ):
        text = (
            jax.jit(_fn(gpu, d, kw))
            .trace(*_specs(q_dt, kv_dt, d, ps, h, kvh, sinks=kw.get("sinks", False)))
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    # Two Triton kernels: the decode (split context) and the prefill configuration.
    assert text.count("__gpu$xla.gpu.triton") == 2


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--topology", required=True)
    print(json.dumps(compile_for_topology(parser.parse_args().topology)), flush=True)
