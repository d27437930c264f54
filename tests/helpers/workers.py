"""Runs of `tests.helpers.sharding_worker` in subprocesses (several CPU
devices need XLA_FLAGS before jax starts; several processes join through
jax.distributed), and the checks every such run shares."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def start_worker(args, devices: int, timeout: int = 900, env=None, **popen):
    env = dict(
        os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **(env or {})
    )
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.sharding_worker", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def worker_result(proc, timeout: int = 900) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"worker timed out:\n{err[-3000:]}") from None
    lines = [l for l in out.splitlines() if l.startswith("{")]
    assert proc.returncode == 0 and lines, f"worker failed (rc {proc.returncode}):\n{err[-4000:]}"
    return json.loads(lines[-1])


def check_run(got: dict, oracle: dict, tp: int, local_shards: int | None = None):
    assert got["shards"] == (local_shards or tp)  # this process's cache shards
    assert got["preemptions"] > 0 and got["prefix_hit_tokens"] > 0 and got["partial_prefills"] > 0
    assert got["tokens"] == oracle["tokens"], f"tensor_parallel_size {tp} changed the tokens"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def follower_result(proc):
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the follower did not exit after process 0 finished") from None
    assert proc.returncode == 0, f"follower failed:\n{err[-3000:]}"
