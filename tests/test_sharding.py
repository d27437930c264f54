"""Tensor parallel over a JAX Mesh: the same greedy tokens as one device
(batched, chunked prefill, prefix caching, preemption), with the reference
and the Pallas interpret backends, KV heads replicated where there are
fewer than shards; two processes through jax.distributed; what one device
holds against the planner; only the collectives Megatron's split needs.

Several CPU devices need XLA_FLAGS before jax starts, so each run is a
subprocess (`tests/helpers/sharding_worker.py`); the one-device oracle is a plain
engine with no mesh in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxkv.config import ModelConfig
from jaxkv.model import memory
from jaxkv.sharding import check_tensor_parallel
from tests.helpers.sharding_worker import TINY
from tests.helpers.workers import check_run, follower_result, free_port, start_worker, worker_result

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def one_device():
    """The oracle: the tiny model's tokens on one device, no mesh."""
    from tests.helpers.sharding_worker import load, run

    return run(load(None), 1, "reference", 8)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_reference_matches_one_device(one_device, tp):
    r = worker_result(start_worker(["tp", "--tp", str(tp)], devices=tp))[str(tp)]
    check_run(r, one_device, tp)
    # What one device holds is what the planner (memory.per_device_bytes) says.
    for name, got in (("one device", one_device), (f"tp {tp}", r)):
        assert got["params_bytes"] == got["planned"]["params"], name
        assert got["kv_bytes"] == got["planned"]["kv"], name
    # KV heads: 2 split over 2 shards, replicated to 4 over 4 (1 per device).
    assert r["kv_bytes"] == one_device["kv_bytes"] // 2
    # Weights shrink by the shard count but for the norms (at 2 shards; at
    # 4 the 2 KV heads' projections are stored twice).
    full = one_device["params_bytes"]
    if tp == 2:
        assert full / 2 < r["params_bytes"] < full / 2 * 1.01
    else:
        assert full / 4 * 1.01 < r["params_bytes"] < full / 2


@pytest.mark.slow
def test_tensor_parallel_pallas_interpret_matches_one_device():
    # One layer, eight prompts of four tokens each in a pool of 12 pages
    # (still preempting): the Pallas TPU kernel's interpret mode compiles
    # slowly on CPU. The oracle: the same model on one device, reference
    # attention, in this process.
    from tests.helpers.sharding_worker import load, run

    proc = start_worker(
        [
            "tp",
            "--tp",
            "4",
            "--backend",
            "pallas",
            "--max-tokens",
            "4",
            "--prompts",
            "8",
            "--num-pages",
            "12",
            "--layers",
            "1",
        ],
        devices=4,
    )
    try:  # the oracle runs while the worker compiles
        oracle = run(load(None, layers=1), 1, "reference", 4, 8, num_pages=12)
    except BaseException:
        proc.kill()
        raise
    runs = worker_result(proc, timeout=1500)
    check_run(runs["4"], oracle, 4)


def test_two_processes_match_one_device(one_device):
    """Process 0 schedules with overlap (`jaxkv generate` on two processes,
    in test_cli_generate_on_two_processes_matches_one, runs without)."""
    port = free_port()
    args = [
        "job",
        "--num-processes",
        "2",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--async-scheduling",
    ]
    procs = [start_worker(args + ["--process-id", str(i)], devices=2) for i in (0, 1)]
    try:
        got = worker_result(procs[0], timeout=900)
        follower_result(procs[1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert got["processes"] == 2 and got["devices"] == 4
    assert got["overlapped_steps"] > 0
    check_run(got, one_device, 4, local_shards=2)


@pytest.mark.slow
def test_smollm2_tensor_parallel_3_matches_one_device(smollm2_gguf):
    # its first 2 layers: the real weights and 9 / 3 heads over 3 devices, a fifteenth to compile
    # one device and three, in two workers side by side
    args = ["tp", "--gguf", str(smollm2_gguf), "--max-tokens", "4", "--layers", "2"]
    procs = [start_worker(args + ["--tp", str(tp)], devices=tp) for tp in (1, 3)]
    try:
        runs = {k: v for p in procs for k, v in worker_result(p, timeout=1500).items()}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert runs["3"]["shards"] == 3
    assert runs["3"]["tokens"] == runs["1"]["tokens"]
    assert runs["3"]["preemptions"] > 0 and runs["3"]["prefix_hit_tokens"] > 0


def test_collectives_are_megatrons_only():
    """The compiled decode and mixed steps at tp 4: per layer one all-reduce
    of [T, E] after the attention output and one after the MLP, one gather
    of the embedded rows [T, E] and one of the logits [S, V]; never a
    weight or the cache."""
    code = (
        "from tests.helpers.sharding_worker import TINY, ENGINE; import re, json\n"
        "from jaxkv.config import EngineConfig; from jaxkv.core.engine import LLMEngine\n"
        "from jaxkv.model.llama import Llama; from jaxkv.worker.buckets import ProgramKey\n"
        "eng = LLMEngine(Llama.random_init(TINY), None, EngineConfig(**ENGINE, "
        "tensor_parallel_size=4))\n"
        "for k in (ProgramKey('decode', 4, 4), ProgramKey('mixed', 64, 8)):\n"
        "    txt = eng.runner.lower(k).compile().as_text()\n"
        "    print(json.dumps(re.findall(r'= (\\S+?)\\{\\S* (all-gather|all-reduce|"
        "reduce-scatter|all-to-all|collective-permute)(?:-start)?\\(', txt)))\n"
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    decode, mixed = (json.loads(l) for l in proc.stdout.splitlines()[-2:])
    E, V, L = TINY.hidden_size, TINY.vocab_size, TINY.num_layers
    for ops, T, S in ((decode, 4, 4), (mixed, 64, 8)):
        want = sorted(
            [[f"f32[{T},{E}]", "all-gather"], [f"f32[{S},{V}]", "all-gather"]]
            + [[f"f32[{T},{E}]", "all-reduce"]] * 2 * L
        )
        assert sorted(ops) == want


@pytest.mark.parametrize(
    "heads,kv,tp,message",
    [
        (9, 3, 2, "9 query heads cannot be split over 2"),
        (8, 4, 3, "8 query heads cannot be split over 3"),
        (8, 2, 8, None),
        (12, 3, 6, None),
        (8, 4, 2, None),
        (12, 4, 6, "6 shards cannot hold whole copies of the model's 4 KV heads"),
        (12, 6, 4, "6 KV heads cannot be split over 4"),
    ],
)
def test_splits_that_cannot_give_whole_heads_are_refused(heads, kv, tp, message):
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=96,
        intermediate_size=96,
        num_layers=1,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=8,
    )
    if message is None:
        stored = check_tensor_parallel(cfg, tp)
        assert stored == max(kv, tp) and stored % tp == 0
    else:
        with pytest.raises(ValueError, match=message):
            check_tensor_parallel(cfg, tp)


def test_llama3_8b_per_device_table():
    """The planner's per-device figures for a Llama-3-8B-shaped model, by
    hand: 8.03e9 parameters, bfloat16."""
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
    )
    one = memory.per_device_bytes(cfg, 1, "bfloat16")["params"]
    assert one == memory.weight_bytes(cfg, "bfloat16") + 64 * 4  # + rotary frequencies
    for tp in (4, 8):
        pd = memory.per_device_bytes(cfg, tp, "bfloat16", num_pages=1000, page_size=16)
        norms = (2 * 32 + 1) * 4096 * 2 + 64 * 4
        assert pd["params"] == (one - norms) // tp + norms
        # 8 KV heads over tp shards: 8 / tp heads of every page per device.
        assert pd["kv"] == 2 * 32 * (8 // tp) * 128 * 16 * 1000 * 2


def test_cli_generate_on_two_processes_matches_one(tmp_path):
    """`jaxkv generate` run on two processes of 2 devices each (tensor
    parallel 4, KV heads replicated) prints what one process prints."""
    from tests.helpers.model_utils import make_hf_model, save_tiny_tokenizer

    _, path = make_hf_model("llama", tmp_path)  # 4 heads, 2 KV heads
    save_tiny_tokenizer(path)
    args = [
        "generate",
        "the cache is a page of the model",
        "--raw",
        "--model",
        str(path),
        "--num-pages",
        "32",
        "--page-size",
        "8",
        "--max-tokens",
        "12",
        "--no-warmup",
    ]
    one = subprocess.run(
        [sys.executable, "-m", "jaxkv", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    port = free_port()
    job = [
        "--tensor-parallel-size",
        "4",
        "--num-processes",
        "2",
        "--coordinator-address",
        f"127.0.0.1:{port}",
    ]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "jaxkv", *args, *job, "--process-id", str(i)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    # gloo (CPU collectives) prints its connections on stdout: "[Gloo] Rank ..."
    # (its lines from several threads may interleave and split: drop any piece of one)
    text = [
        [l for l in o.splitlines() if not l.startswith("[Gloo]") and "peer ranks" not in l]
        for o, _ in outs
    ]
    assert text[0] == one.stdout.splitlines() and one.stdout.strip()
    assert text[1] == []  # the follower prints nothing


def test_estimate_per_device(capsys):
    # 2 layers, 4 heads, 2 KV heads, D 16, E 64, F 96, V 128
    import tempfile

    from jaxkv.entrypoints import cli
    from tests.helpers.model_utils import make_hf_model

    with tempfile.TemporaryDirectory() as d:
        _, path = make_hf_model("llama", Path(d))
        assert (
            cli.main(
                [
                    "estimate",
                    "--model",
                    str(path),
                    "--tensor-parallel-size",
                    "2",
                    "--context",
                    "32",
                    "--kv-dtype",
                    "float32",
                    "--weight-dtype",
                    "float32",
                ]
            )
            == 0
        )
    out = capsys.readouterr().out
    # 3 pages (2 for 32 tokens, the trash page) x 16 tokens x 2 layers x 2 (K, V)
    # x 2 KV heads x 16 x 4 bytes = 24,576; 12,288 per device with one head each.
    assert "| kv | 24,576 (0.00 GiB) | 12,288 (0.00 GiB) |" in out
    assert "| KV heads (KVH) | 1 |" in out
    assert (
        cli.main(
            [
                "estimate",
                "--layers",
                "2",
                "--kv-heads",
                "2",
                "--head-dim",
                "16",
                "--tensor-parallel-size",
                "2",
            ]
        )
        == 2
    )
    assert "needs --model" in capsys.readouterr().err
