"""Deviceless compiles of a Qwen3-30B-A3B-shaped mixture of experts
(issue 28): its decode and mixed (prefill) step programs, expert parallel
over the "model" axis, compiled for a TPU slice from libtpu's topology
description, or lowered for CUDA over an abstract mesh of GPUs. Nothing is
materialized (`jaxkv.worker.aot`).

    python scripts/bench/moe_compile.py v5e:2x4 --ep 8 --kind decode     # one JSON line
    python scripts/bench/moe_compile.py cuda --ep 8 --kind mixed --layers 2

The TPU compile needs libtpu on the path, in a process of its own
(`tpu_env`: .tpu-compiler, as tests/worker/test_sharding_compile.py does); the
CUDA lowering needs nothing. `scripts/bench/moe.py --what compile` runs
this for both slices and both programs at full depth.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

REPO = Path(__file__).resolve().parents[2]
PAGE_SIZE = 16
# (chip HBM bytes, KV pool per device) by TPU generation
CHIPS = {
    "v5e": (16 * 2**30, 6 * 2**30),
    "v6e": (32 * 2**30, 16 * 2**30),
    "cuda": (80 * 2**30, 32 * 2**30),
}
# The step programs compiled: (kind, tokens T, sequences S)
KINDS = {"decode": ("decode", 64, 64), "mixed": ("mixed", 512, 64)}


def qwen3_30b_a3b(layers: int = 48):
    """Qwen3-30B-A3B's shapes (its config.json), every layer sparse;
    `layers` < 48: its first layers only, at full width."""
    from jaxkv.config import ModelConfig

    return ModelConfig(
        architecture="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=layers,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    )


def tpu_compiler() -> Path:
    return Path(os.environ.get("JAXKV_TPU_COMPILER", REPO / ".tpu-compiler"))


def tpu_env() -> dict | None:
    """The environment of a subprocess that sees libtpu; None without it."""
    compiler = tpu_compiler()
    if not (compiler / "libtpu").is_dir():
        return None
    return dict(
        os.environ,
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(REPO), str(compiler)]),
    )


def pages_for(cfg, tp: int, kv_bytes: int) -> int:
    from jaxkv.model import memory

    return (
        kv_bytes
        // memory.per_device_bytes(cfg, tp, "bfloat16", num_pages=1, page_size=PAGE_SIZE)["kv"]
    )


def lowered_all_reduces(text: str) -> dict:
    """{operand type: count} of the lowered StableHLO's all-reduces: those
    written in the program (shard_map's psum), before XLA's partitioner
    adds its own; a sparse layer's is one "64x2048xf32" ([T, E] float32)."""
    out: dict = {}
    for m in re.finditer(r'"stablehlo\.all_reduce"', text):
        typ = re.search(r"\}\) : \(tensor<([^>]*)>\)", text[m.end() :])
        key = typ.group(1) if typ else "?"
        out[key] = out.get(key, 0) + 1
    return out


def compiled_collectives(text: str) -> dict:
    """{op: {result shape: count}} of the collectives in compiled HLO text."""
    out: dict = {}
    for m in re.finditer(
        r"= (\w+\[[\d,]*\])\S* (all-reduce|all-to-all|all-gather|reduce-scatter|"
        r"collective-permute|ragged-all-to-all)(?:-start)?\(",
        text,
    ):
        ops = out.setdefault(m.group(2), {})
        ops[m.group(1)] = ops.get(m.group(1), 0) + 1
    return out


def compile_tpu(topology: str, ep: int, kind: str, layers: int) -> dict:
    """Compile the `kind` step of `layers` layers for `topology` (EP `ep`)."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    from jaxkv.model import memory
    from jaxkv.sharding import AXES, shard_nbytes
    from jaxkv.worker.aot import abstract_runner
    from jaxkv.worker.buckets import ProgramKey

    topo = topologies.get_topology_desc(topology, "tpu")
    mesh = Mesh(np.array(topo.devices[:ep]).reshape(1, ep), AXES)
    cfg = qwen3_30b_a3b(layers)
    hbm, kv_bytes = CHIPS[topology.split(":")[0]]
    pages = pages_for(cfg, ep, kv_bytes)
    key = ProgramKey(*KINDS[kind])
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):  # Mosaic reads the chip generation from the ambient mesh
        runner = abstract_runner(
            cfg, mesh, num_pages=pages, page_size=PAGE_SIZE, platform="tpu", expert_parallel=True
        )
        lowered = runner.lower(key)
        lower_s = time.perf_counter() - t0
        compiled = lowered.compile()
    compile_s = time.perf_counter() - t0 - lower_s
    ma, text = compiled.memory_analysis(), compiled.as_text()
    planned = memory.per_device_bytes(cfg, ep, "bfloat16", num_pages=pages, page_size=PAGE_SIZE)
    params = shard_nbytes(runner.state)
    return dict(
        target=topology,
        ep=ep,
        kind=kind,
        tokens=key[1],
        seqs=key[2],
        layers=layers,
        pages=pages,
        lower_s=round(lower_s, 1),
        compile_s=round(compile_s, 1),
        argument=ma.argument_size_in_bytes,
        output=ma.output_size_in_bytes,
        alias=ma.alias_size_in_bytes,
        temp=ma.temp_size_in_bytes,
        peak=ma.argument_size_in_bytes
        + ma.output_size_in_bytes
        - ma.alias_size_in_bytes
        + ma.temp_size_in_bytes,
        hbm=hbm,
        planned_params=planned["params"],
        planned_kv=planned["kv"],
        planned_total=planned["total"],
        sharded_params=params,
        lowered_all_reduce=lowered_all_reduces(lowered.as_text()),
        compiled=compiled_collectives(text),
        ragged_dot="ragged-dot" in text,
    )


def lower_cuda(ep: int, kind: str, layers: int) -> dict:
    """Lower the `kind` step for CUDA over an abstract mesh of `ep` GPUs."""
    import jax

    from jaxkv.sharding import AXES
    from jaxkv.worker.aot import lower_step

    dev = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"
    )
    mesh = jax.sharding.AbstractMesh((1, ep), AXES, abstract_device=dev)
    cfg = qwen3_30b_a3b(layers)
    kind_, T, S = KINDS[kind]
    t0 = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = lower_step(
            cfg,
            mesh,
            kind=kind_,
            tokens=T,
            seqs=S,
            num_pages=pages_for(cfg, ep, CHIPS["cuda"][1]),
            page_size=PAGE_SIZE,
            platform="gpu",
            lowering_platforms=("cuda",),
            expert_parallel=True,
        )
    text = lowered.as_text()
    return dict(
        target="cuda",
        ep=ep,
        kind=kind,
        tokens=T,
        seqs=S,
        layers=layers,
        lower_s=round(time.perf_counter() - t0, 1),
        triton="__gpu$xla.gpu.triton" in text,
        manual_computations=text.count("sdy.manual_computation"),
        ragged_dot="ragged_dot" in text,
        lowered_all_reduce=lowered_all_reduces(text),
        all_to_all="all_to_all" in text,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/bench/moe_compile.py", description=__doc__.split("\n")[0]
    )
    p.add_argument("target", help='a TPU topology ("v5e:2x4", "v6e:2x4") or "cuda"')
    p.add_argument("--ep", type=int, default=8, help="expert-parallel (model axis) size")
    p.add_argument("--kind", choices=sorted(KINDS), default="decode")
    p.add_argument("--layers", type=int, default=48, help="the model's first N layers")
    a = p.parse_args(argv)
    if a.target == "cuda":
        out = lower_cuda(a.ep, a.kind, a.layers)
    else:
        out = compile_tpu(a.target, a.ep, a.kind, a.layers)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
