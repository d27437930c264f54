"""Mixture-of-experts models split over devices: expert parallelism (whole
experts per device) and tensor parallelism (every expert's intermediate
split) on CPU devices and over two processes, against the one-device run;
splits that do not divide are refused by name."""

from __future__ import annotations

import pytest

from jaxkv.model_config import ModelConfig

# One worker runs the module, so the one-device oracle runs once for all three.
pytestmark = pytest.mark.xdist_group("moe_parallel")


@pytest.fixture(scope="module")
def oracle():
    from tests.helpers.sharding_worker import load, run

    return run(load(None, moe=True), 1, "reference", 6, 8)


def test_expert_parallel_2_and_tensor_parallel_2_match_one_device(oracle):
    """Experts split whole (EP 2) or by their intermediate (TP 2) on CPU
    devices: the one-device tokens, with what each device holds as the
    planner says (the same bytes either way: X/t whole experts or every
    expert's Fm/t)."""
    from tests.helpers.workers import check_run, start_worker, worker_result

    runs = worker_result(
        start_worker(
            ["tp", "--moe", "--tp", "2,ep2", "--max-tokens", "6", "--prompts", "8"], devices=2
        )
    )
    for name, r in runs.items():
        check_run(r, oracle, int(name.removeprefix("ep")))
        assert r["params_bytes"] == r["planned"]["params"], name
    assert runs["ep2"]["params_bytes"] == runs["2"]["params_bytes"]


def test_expert_parallel_4_matches_one_device(oracle):
    """EP 4 on four CPU devices: the one-device tokens; each device holds two
    of the eight experts, as the planner says."""
    from jaxkv.model import memory
    from tests.helpers.sharding_worker import MOE
    from tests.helpers.workers import check_run, start_worker, worker_result

    r = worker_result(
        start_worker(
            ["tp", "--moe", "--tp", "ep4", "--max-tokens", "6", "--prompts", "8"], devices=4
        )
    )["ep4"]
    check_run(r, oracle, 4)
    assert r["params_bytes"] == r["planned"]["params"]
    per_expert = 3 * MOE.hidden_size * MOE.moe_intermediate_size * 4
    ep2 = memory.per_device_bytes(MOE, 2, "float32")["params"]
    assert ep2 - r["params_bytes"] > 2 * per_expert


def test_expert_parallel_over_two_processes_matches_one_device(oracle):
    """EP 4 over two processes of two CPU devices each, through
    jax.distributed: the one-device tokens."""
    from tests.helpers.workers import (
        check_run,
        follower_result,
        free_port,
        start_worker,
        worker_result,
    )

    port = free_port()
    job = [
        "job",
        "--moe",
        "--expert-parallel",
        "--max-tokens",
        "6",
        "--prompts",
        "8",
        "--num-processes",
        "2",
        "--coordinator",
        f"127.0.0.1:{port}",
    ]
    procs = [start_worker(job + ["--process-id", str(i)], devices=2) for i in (0, 1)]
    try:
        two = worker_result(procs[0])
        follower_result(procs[1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert two["processes"] == 2 and two["devices"] == 4
    check_run(two, oracle, 4, local_shards=2)


@pytest.mark.parametrize(
    "tp, ep, match",
    [
        (3, True, "8 experts cannot be split evenly over tensor_parallel_size=3"),
        (3, False, "intermediate size 32 is not divisible by 3"),
        (16, True, "8 experts cannot be split"),
        (4, True, None),
        (8, True, None),
        (2, False, None),
    ],
)
def test_expert_splits_that_do_not_divide_are_refused(tp, ep, match):
    from jaxkv.sharding import check_expert_split

    cfg = ModelConfig(
        architecture="qwen3_moe",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=16,
        num_kv_heads=16,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    if match is None:
        check_expert_split(cfg, tp, ep)
    else:
        with pytest.raises(ValueError, match=match):
            check_expert_split(cfg, tp, ep)
