"""The engine replicas of `jaxkv serve --data-parallel-size N`: N child
`jaxkv serve` processes, each with its own devices (a CPU core each on a
CPU, its own GPUs through CUDA_VISIBLE_DEVICES), scheduler and page pool,
listening on 127.0.0.1 behind a key only the front knows.

`Replicas` starts them, watches them (a replica that exits is started again;
its requests in flight end with a named error in the front), follows the
pages each one caches through its KV events, and picks the replica for a
request: the one holding the longest run of the prompt's pages, by load on
a tie or a miss (`pick`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from jaxkv.core.scheduling.page_pool import prompt_page_hashes, salted_root
from jaxkv.entrypoints.openai.kv_events import block_hash

log = logging.getLogger("jaxkv.serve")

# `jaxkv serve` options the front owns: a replica gets its own values.
FRONT_OPTIONS = {
    "--host": 1,
    "--port": 1,
    "--api-key": 1,
    "--allowed-hosts": 1,
    "--kv-events-config": 1,
    "--data-parallel-size": 1,
    "--max-connections": 1,
    "--enable-kv-map": 0,
}
START_TIMEOUT = 900.0  # seconds a replica may take to load and compile


def child_argv(argv: list[str]) -> list[str]:
    """`argv` (the serve command's options) without the front's own."""
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in FRONT_OPTIONS:
            skip = FRONT_OPTIONS[name] if "=" not in a else 0
            continue
        out.append(a)
    return out


def cpu_sets(n: int) -> list[set[int] | None]:
    """The cores of each of n replicas: this process's cores dealt out in
    contiguous runs (None: no pinning, more replicas than cores)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < n:
        return [None] * n
    per = len(cores) // n
    return [set(cores[i * per : (i + 1) * per]) for i in range(n)]


def gpu_lists(n: int, tp: int) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica (tp GPUs each), or None when no
    NVIDIA GPU is seen; too few GPUs is a ValueError."""
    if shutil.which("nvidia-smi") is None:
        return [None] * n
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        count = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        return [None] * n
    if count == 0:
        return [None] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    if len(ids) < n * tp:
        raise ValueError(
            f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} GPUs, "
            f"{len(ids)} visible"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(n)]


class Replica:
    def __init__(self, rank: int, port: int, events: dict, cpus, gpus):
        self.rank = rank
        self.port = port
        self.events = events  # its KV events config (vLLM's shape)
        self.cpus = cpus  # the cores it is pinned to (None: not pinned)
        self.gpus = gpus  # its CUDA_VISIBLE_DEVICES (None: not set)
        self.proc: subprocess.Popen | None = None
        self.healthy = False
        self.started = 0.0
        self.restarts = 0
        self.in_flight = 0  # requests the front has sent it and not seen end
        self.pages: set[int] = set()  # its cached pages (event hashes)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def describe(self) -> dict:
        return {
            "rank": self.rank,
            "pid": self.proc.pid if self.proc else None,
            "healthy": self.healthy,
            "restarts": self.restarts,
            "in_flight": self.in_flight,
            "cached_pages": len(self.pages),
        }


class NoReplica(RuntimeError):
    """No replica is up to take a request."""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _offset(endpoint: str, rank: int) -> str:
    """A tcp endpoint's port moved up by `rank` (vLLM gives each
    data-parallel rank its own port so); other transports get a suffix."""
    if endpoint.startswith("tcp://"):
        head, port = endpoint.rsplit(":", 1)
        return f"{head}:{int(port) + rank}"
    return f"{endpoint}-{rank}"


class Replicas:
    """N replica processes of `jaxkv serve ARGV`, with `tp` devices each;
    `events_cfg`: the user's KV events config (each replica publishes at
    its endpoint's port + rank), else private ipc sockets the front reads."""

    def __init__(
        self,
        argv: list[str],
        n: int,
        *,
        tp: int = 1,
        page_size: int = 16,
        events_cfg: dict | None = None,
    ):
        if n < 2:
            raise ValueError(f"data_parallel_size: replicas need at least 2, got {n}")
        self.argv = child_argv(argv)
        self.n = n
        self.page_size = page_size
        self.key = secrets.token_urlsafe(32)
        self.user_events = events_cfg is not None
        self._dir = tempfile.mkdtemp(prefix="jaxkv-dp-")  # 0700: the ipc sockets stay ours
        cpus, gpus = cpu_sets(n), gpu_lists(n, tp)
        self.replicas = []
        for i in range(n):
            if events_cfg is not None:
                ev = {**events_cfg, "endpoint": _offset(events_cfg["endpoint"], i)}
                if events_cfg.get("replay_endpoint"):
                    ev["replay_endpoint"] = _offset(events_cfg["replay_endpoint"], i)
            else:
                ev = {"endpoint": f"ipc://{self._dir}/events-{i}", "topic": ""}
            self.replicas.append(Replica(i, _free_port(), ev, cpus[i], gpus[i]))
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self._stop = threading.Event()
        self._events_thread = threading.Thread(target=self._follow_events, daemon=True)

    # ---------------------------------------------------------- processes

    def _spawn(self, r: Replica) -> None:
        import json

        env = {**os.environ, "JAXKV_API_KEY": self.key}
        if r.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = r.gpus
        cmd = [
            sys.executable,
            "-m",
            "jaxkv",
            "serve",
            *self.argv,
            "--host",
            "127.0.0.1",
            "--port",
            str(r.port),
            "--data-parallel-rank",
            str(r.rank),
            "--kv-events-config",
            json.dumps({"publisher": "zmq", **r.events}),
        ]
        cpus = r.cpus

        def setup():  # in the child, before exec: its cores; it dies with the front
            if cpus:
                os.sched_setaffinity(0, cpus)
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

        r.proc = subprocess.Popen(cmd, env=env, preexec_fn=setup)
        r.healthy, r.started = False, time.monotonic()
        r.pages.clear()

    def start(self) -> None:
        """Start every replica and wait until each answers /health; one that
        exits first stops the start with its exit status (a bad option or
        model fails in every replica alike)."""
        for r in self.replicas:
            self._spawn(r)
        self._events_thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(timeout=2.0) as c:
            while not all(r.healthy for r in self.replicas):
                for r in self.replicas:
                    if r.proc.poll() is not None:
                        self.close()
                        raise RuntimeError(
                            f"data-parallel replica {r.rank} exited with status "
                            f"{r.proc.returncode} while starting (its log is above)"
                        )
                    if not r.healthy:
                        try:
                            r.healthy = c.get(r.url + "/health").status_code == 200
                        except httpx.HTTPError:
                            pass
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"data-parallel replicas not up within {START_TIMEOUT} s")
                time.sleep(0.25)
        log.warning("jaxkv serve: %d data-parallel replicas up", self.n)

    async def watch(self) -> None:
        """Restart replicas that exit (at most one start per replica every
        10 s); mark a restarted one healthy once its /health answers."""
        while not self._stop.is_set():
            for r in self.replicas:
                if r.proc.poll() is not None:
                    if r.healthy:
                        log.error(
                            "jaxkv serve: data-parallel replica %d exited (status %s); "
                            "restarting it",
                            r.rank,
                            r.proc.returncode,
                        )
                    r.healthy = False
                    if time.monotonic() - r.started > 10:
                        r.restarts += 1
                        self._spawn(r)
                elif not r.healthy:
                    try:
                        got = await self.client.get(r.url + "/health", timeout=2.0)
                        r.healthy = got.status_code == 200
                    except httpx.HTTPError:
                        pass
            await asyncio.sleep(0.25)

    def close(self, timeout: float = 30.0) -> None:
        """SIGTERM every replica (each drains its requests), then kill what
        is left after `timeout` s."""
        self._stop.set()
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            if r.proc is None:
                continue
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------- routing

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    def least_loaded(self) -> Replica:
        live = self.healthy()
        if not live:
            raise NoReplica("no data-parallel replica is up (all are restarting); retry")
        return min(live, key=lambda r: (r.in_flight, r.rank))

    def page_hashes(self, ids: list[int], cache_salt: str | None = None) -> list[int]:
        """The event hashes of the prompt's full pages that a prefix hit
        may cover (never the last token's), as the replicas' pools name them."""
        return [
            block_hash(h) for h in prompt_page_hashes(ids, self.page_size, salted_root(cache_salt))
        ]

    def pick(self, hashes: list[int]) -> tuple[Replica, int]:
        """(the replica for a prompt with these page hashes, the pages it
        holds): the longest cached run wins, unless it is busier than the
        least loaded replica by more than 4 + that one's load (then the
        least loaded, as on a tie at 0 or a miss)."""
        low = self.least_loaded()
        best, most = low, 0
        for r in self.healthy():
            k = 0
            for h in hashes:
                if h not in r.pages:
                    break
                k += 1
            if k > most or (k == most and k and r.in_flight < best.in_flight):
                best, most = r, k
        if best.in_flight > 2 * low.in_flight + 4:
            return low, 0
        return best, most

    # -------------------------------------------------------------- events

    def _follow_events(self) -> None:
        """Keep each replica's cached page set from its KV events."""
        import msgpack
        import zmq

        ctx = zmq.Context()
        socks = {}
        for r in self.replicas:
            s = ctx.socket(zmq.SUB)
            s.connect(r.events["endpoint"].replace("tcp://*:", "tcp://127.0.0.1:"))
            s.setsockopt(zmq.SUBSCRIBE, r.events.get("topic", "").encode())
            socks[s] = r
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for s, _ in poller.poll(200):
                    _, _, payload = s.recv_multipart()
                    self._apply(socks[s], msgpack.unpackb(payload)[1])
        finally:
            ctx.destroy(linger=0)

    @staticmethod
    def _apply(r: Replica, events: list) -> None:
        for ev in events:
            if ev[0] == "BlockStored":
                r.pages.update(ev[1])
            elif ev[0] == "BlockRemoved":
                r.pages.difference_update(ev[1])
            elif ev[0] == "AllBlocksCleared":
                r.pages.clear()
