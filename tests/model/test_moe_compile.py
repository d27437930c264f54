"""A Qwen3-30B-A3B-shaped mixture of experts (128 experts, top 8, every
layer sparse) built for hardware this machine does not have, expert
parallel over 8 devices, nothing materialized (scripts/bench/moe_compile.py):

- its decode step compiled deviceless for TPU v5e:2x4 (EP 8): the
  per-device parameters are the planner's, the arguments the planner's
  weights and KV pool plus the step's metadata, the peak fits the chip,
  the experts are XLA's ragged dot, and the only collectives are one
  all-reduce of [T, E] per sparse layer for the experts (plus attention's
  own, and the embedding's and the logits' gathers): no all-to-all;
- its decode and mixed steps lowered for CUDA over an abstract 8-GPU mesh.

The tests use the model's first two layers at full width (every kind of
layer there is, in a fraction of the compile time); the README's figures
are the whole 48 layers' (`python scripts/bench/moe.py --what compile`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxkv.model import memory

REPO = Path(__file__).resolve().parents[2]
from scripts.bench import moe_compile as bmc  # noqa: E402  (scripts/bench/moe_compile.py)

LAYERS = 2
EP = 8


def test_qwen3_moe_shape_is_qwen3_30b_a3b():
    cfg = bmc.qwen3_30b_a3b()
    assert memory.param_count(cfg) == pytest.approx(30.5e9, rel=0.01)
    assert memory.active_param_count(cfg) == pytest.approx(3.3e9, rel=0.03)
    assert all(cfg.layer_sparse(i) for i in range(cfg.num_layers))


def test_expert_parallel_decode_compiles_for_v5e_2x4():
    env = bmc.tpu_env()
    if env is None:
        pytest.skip(f"libtpu is not in {bmc.tpu_compiler()} (bash .ci/install_tpu_compiler.sh)")
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "bench" / "moe_compile.py"),
            "v5e:2x4",
            f"--ep={EP}",
            "--kind=decode",
            f"--layers={LAYERS}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}:\n{proc.stderr[-4000:]}"
    got = json.loads(lines[-1])
    print(json.dumps(got))  # the figures, for the record (-s)
    cfg = bmc.qwen3_30b_a3b(LAYERS)
    planned = memory.per_device_bytes(
        cfg, EP, "bfloat16", num_pages=got["pages"], page_size=bmc.PAGE_SIZE
    )
    # The abstract parameters' shards (16 whole experts of 128 per device) are the planner's.
    assert got["sharded_params"] == planned["params"]
    assert planned["experts"] == LAYERS * (128 // EP) * 3 * 2048 * 768 * 2
    # Arguments: the planned weights and KV pool, plus the step's metadata (< 1 MiB).
    assert planned["total"] <= got["argument"] < planned["total"] + 2**20
    assert planned["kv"] <= got["alias"] <= planned["kv"] + 2**12  # the donated cache
    assert got["peak"] < got["hbm"]
    assert got["ragged_dot"], "the experts are not XLA's ragged dot"
    T, E = got["tokens"], cfg.hidden_size
    # As written: the experts' partial sums, one float32 [T, E] psum per layer, nothing else.
    assert got["lowered_all_reduce"] == {f"{T}x{E}xf32": LAYERS}
    compiled = got["compiled"]
    assert "all-to-all" not in compiled and "ragged-all-to-all" not in compiled
    # Compiled: each layer's two [T, E] all-reduces (attention's output
    # projection, the experts; XLA sums both in bf16, the activations'
    # dtype), the embedding rows' gather and the logits' gather.
    assert compiled["all-reduce"] == {f"bf16[{T},{E}]": 2 * LAYERS}
    assert sum(compiled["all-gather"].values()) == 2
    assert set(compiled) == {"all-reduce", "all-gather"}


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_expert_parallel_step_lowers_for_cuda_on_8_gpus(kind):
    got = bmc.lower_cuda(EP, kind, LAYERS)
    assert got["triton"]  # the Pallas Triton attention kernel
    assert got["ragged_dot"] and not got["all_to_all"]
    assert got["lowered_all_reduce"] == {f"{got['tokens']}x2048xf32": LAYERS}
    # Per layer: attention's cache write and kernel, and the experts, each under shard_map.
    assert got["manual_computations"] == 2 * LAYERS
