"""Several processes (hosts) running one engine through `jax.distributed`.

Requests enter on process 0, the leader, whose scheduler alone decides what
runs. Every device program the leader's Runner runs, it first sends to the
other processes (the followers) as a message: the Runner method and its
host arguments (the step batch, page pairs, ...). Each follower runs the
same method on its own Runner, so every process launches the same SPMD
program on the same batch in the same order, and the schedulers cannot
diverge because there is only one.

Messages travel through JAX's own collectives
(`jax.experimental.multihost_utils.broadcast_one_to_all`, gloo on CPU,
NCCL / ICI on accelerators): a fixed-size header with the length, then the
pickled message padded to a power-of-two bucket (so the broadcast compiles
once per bucket). The peers are the processes of one job, which trust
each other as they trust their own checkpoint.

    init_distributed(coordinator_address, num_processes, process_id)
    channel = Channel()            # on every process, after init
    Leader(channel).send(...)      # process 0: its Runner's calls
    Follower(channel).run(runner)  # processes 1..n-1: the same calls, in order
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

import numpy as np

log = logging.getLogger("jaxkv")
MIN_BUCKET = 1 << 12


def init_distributed(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> bool:
    """Join the job through `jax.distributed.initialize` when it has several
    processes (`num_processes` > 1, or the environment's JAXKV_NUM_PROCESSES
    / JAXKV_PROCESS_ID / JAX_COORDINATOR_ADDRESS); returns whether this
    process is part of a multi-process job. Call before anything touches a
    device. CPU collectives go through gloo."""
    import jax

    env = os.environ
    num_processes = num_processes or _env_int("JAXKV_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("JAXKV_PROCESS_ID")
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    if not num_processes or num_processes == 1:
        return False
    if process_id is None or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id: must be in [0, {num_processes}) for a job of "
            f"{num_processes} processes, got {process_id!r}"
        )
    if not coordinator_address:
        raise ValueError(
            "coordinator_address: required with num_processes > 1 "
            "(host:port of process 0, e.g. 127.0.0.1:12355)"
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    log.info(
        "jaxkv: process %d of %d joined %s (%d devices in all)",
        process_id,
        num_processes,
        coordinator_address,
        jax.device_count(),
    )
    return True


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}: must be an integer, got {v!r}") from None


def _bucket(n: int) -> int:
    return max(MIN_BUCKET, 1 << (max(n, 1) - 1).bit_length())


class Channel:
    """Process 0 sends, every other process receives, message by message."""

    def __init__(self):
        import jax

        self.process_index = jax.process_index()
        self.num_processes = jax.process_count()
        self.leader = self.process_index == 0

    @staticmethod
    def _broadcast(x: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(x))

    def send(self, msg: Any) -> None:
        if not self.leader:
            raise RuntimeError(
                f"process {self.process_index} follows process 0 and cannot "
                "send; requests enter on process 0 only"
            )
        data = np.frombuffer(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self._broadcast(np.array([len(data)], np.int32))
        buf = np.zeros(_bucket(len(data)), np.uint8)
        buf[: len(data)] = data
        self._broadcast(buf)

    def recv(self) -> Any:
        n = int(self._broadcast(np.zeros(1, np.int32))[0])
        buf = self._broadcast(np.zeros(_bucket(n), np.uint8))
        return pickle.loads(buf[:n].tobytes())


def scale_out(model, config):
    """(model, ShardingPlan or None, Channel or None) for an engine: when
    the model is split over several devices, the model sharded
    (`jaxkv.sharding.shard_model`) and its plan; a channel when the job has
    several processes (whose model is split over every device of the
    job)."""
    import jax

    from jaxkv.sharding import ShardingPlan, shard_model

    tp = config.tensor_parallel_size
    procs = jax.process_count()
    if procs > 1 and tp != jax.device_count():
        raise ValueError(
            f"tensor_parallel_size: a job of {procs} processes runs one model "
            f"over all its {jax.device_count()} devices; set "
            f"tensor_parallel_size={jax.device_count()} (got {tp})"
        )
    if tp == 1:
        return model, None, None
    plan = ShardingPlan.make(model.config, tp, expert_parallel=config.enable_expert_parallel)
    return shard_model(model, plan), plan, Channel() if procs > 1 else None


class Leader:
    """Process 0's side: every device call its Runner makes is first sent
    to the other processes (`send`), and at the end (`stop`, also run at
    exit) they are told to return."""

    def __init__(self, channel: Channel):
        import atexit

        if not channel.leader:
            raise RuntimeError(
                f"process {channel.process_index} follows process 0: requests "
                "enter on process 0 only"
            )
        self.channel = channel
        self._stopped = False
        atexit.register(self.stop)

    def send(self, method: str, *args) -> None:
        self.channel.send((method, args))

    def stop(self) -> None:
        """Tell the followers to return from `Follower.run` (once)."""
        if not self._stopped:
            self._stopped = True
            self.channel.send(None)


class Follower:
    """Processes 1..n-1: run process 0's Runner calls on this process's
    Runner, in order, until process 0 stops."""

    def __init__(self, channel: Channel):
        if channel.leader:
            raise RuntimeError("follow: only processes other than 0 of a multi-process job follow")
        self.channel = channel

    def run(self, runner) -> int:
        """Returns the number of calls run."""
        n = 0
        while (msg := self.channel.recv()) is not None:
            method, args = msg
            getattr(runner, method)(*args)
            n += 1
        return n
