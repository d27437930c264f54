"""Shared pieces of the generation benchmarks (scripts/bench/generation.py): the fixed
workload (prompt text, sizes, lengths), timing helpers, the memory
bandwidth probe and the compile meter."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

TEXT = (
    "The harbour town woke before the sun. Fishermen checked their nets by lamplight, "
    "counting knots and mending the places where the sea had chewed through the twine. "
    "A baker on the hill pulled the first loaves from an oven that had been burning since "
    "midnight, and the smell drifted down the narrow streets to the water. Gulls waited on "
    "the chimneys. In the old customs house, a clerk unlocked the ledger room and opened "
    "the shutters, letting in a grey light that made the dust look like fog. She wrote the "
    "date at the top of a clean page and listed the boats expected that day: three from the "
    "northern islands with wool and dried fish, one from the mainland with lamp oil, nails "
    "and letters, and a small trading ketch whose captain never arrived on the day he "
    "promised. By seven the quay was loud with carts. Children carried baskets of bread to "
    "the crews, dogs argued over scraps, and the harbour master walked the length of the "
    "stone pier with his hands behind his back, reading the sky. The wind had turned in the "
    "night. Clouds stacked up over the western headland, low and heavy, and the water in "
    "the outer channel had the flat, oily look that the older sailors distrusted. He sent a "
    "boy to ring the bell twice, the signal that boats should stay within sight of the "
    "light. Most crews grumbled and obeyed. One did not. By noon the rain came sideways "
    "across the bay, and the town gathered at the windows to count the sails coming home."
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Workload sizes. Prompt/output length ranges are inclusive."""

    decode_batches: tuple[int, ...] = (1, 16, 64)
    hf_decode_batches: tuple[int, ...] = (1, 16)  # HF only where a ratio needs it
    decode_prompt: int = 64  # P
    decode_steps: int = 32  # N
    prefill_lens: tuple[int, ...] = (256, 1024, 4096)  # one step each (budget >= n)
    prefill_chunked: tuple[int, ...] = (4096,)  # in chunks of the default token budget
    e2e_requests: int = 64
    e2e_prompt: tuple[int, int] = (16, 128)
    e2e_output: tuple[int, int] = (8, 40)
    sequential_runs: int = 1  # the sequential pass is long; its many steps average well
    bandwidth_bytes: int = 1 << 30


FULL = Sizes()
QUICK = Sizes(
    decode_steps=8,
    prefill_lens=(256,),
    prefill_chunked=(),
    e2e_requests=16,
    e2e_output=(4, 16),
    bandwidth_bytes=256 << 20,
)


# ------------------------------------------------------------------ helpers


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _num_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def prompt_stream(tokenizer, vocab_size: int, length: int) -> list[int]:
    """At least `length` fixed token ids: the built-in text encoded and
    repeated, or (no tokenizer) a fixed pseudo-random sequence."""
    if tokenizer is not None:
        base = tokenizer.encode(TEXT, add_special_tokens=False)
    else:
        base = np.random.default_rng(1234).integers(1, vocab_size, 997).tolist()
    reps = -(-length // len(base))
    return (base * reps)[:length]


def make_prompts(stream: list[int], lengths: list[int]) -> list[list[int]]:
    """Prompt i: lengths[i] tokens of the (cyclic) stream from offset 37 i."""
    doubled = stream + stream
    out = []
    for i, n in enumerate(lengths):
        if n > len(stream):
            raise ValueError(f"prompt of {n} tokens is longer than the stream ({len(stream)})")
        off = (37 * i) % len(stream)
        out.append(doubled[off : off + n])
    return out


def e2e_lengths(sizes: Sizes) -> tuple[list[int], list[int]]:
    """Fixed mixed prompt and output lengths for the e2e phase."""
    rng = np.random.default_rng(2024)
    p = rng.integers(sizes.e2e_prompt[0], sizes.e2e_prompt[1] + 1, sizes.e2e_requests)
    o = rng.integers(sizes.e2e_output[0], sizes.e2e_output[1] + 1, sizes.e2e_requests)
    return p.tolist(), o.tolist()


def measure_bandwidth(nbytes: int, repeats: int = 5) -> dict[str, Any]:
    """Memory read bandwidth over an `nbytes` float32 array, three ways: a
    numpy sum on one thread, numpy sums split over every core (numpy
    releases the GIL in reductions), and a BLAS matrix-vector product
    ([n / 1024, 1024] @ [1024], threaded by numpy's BLAS). A float32 sum is
    partly bound by its adds on some CPUs (seen: 7 GB/s where the product
    reads 26 GB/s), so the largest median is taken as the machine's read
    bandwidth."""
    a = np.ones(nbytes // 4, np.float32)
    a.sum()
    one = [nbytes / _timed(a.sum)[0] for _ in range(repeats)]
    k = _num_cores()
    parts = np.array_split(a, k)
    with concurrent.futures.ThreadPoolExecutor(k) as ex:
        list(ex.map(np.sum, parts))
        multi = [nbytes / _timed(lambda: list(ex.map(np.sum, parts)))[0] for _ in range(repeats)]
    m, v = a[: a.size // 1024 * 1024].reshape(-1, 1024), np.ones(1024, np.float32)
    m @ v
    gemv = [m.nbytes / _timed(lambda: m @ v)[0] for _ in range(repeats)]
    one_m, multi_m, gemv_m = _median(one), _median(multi), _median(gemv)
    return dict(
        array_bytes=nbytes,
        repeats=repeats,
        threads=k,
        numpy_sum_1thread_bytes_per_s=one_m,
        numpy_sum_threads_bytes_per_s=multi_m,
        blas_gemv_bytes_per_s=gemv_m,
        read_bytes_per_s=max(one_m, multi_m, gemv_m),
        runs_1thread=one,
        runs_threads=multi,
        runs_gemv=gemv,
    )


class CompileMeter:
    """Counts and times jax compiles (jax.monitoring events) while active.
    A compile served by the persistent compilation cache counts as a cache
    hit and costs only its retrieval."""

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self):
        self.seconds = 0.0
        self.compiles = 0
        self.cache_hits = 0

    def _duration(self, event: str, duration: float, **_):
        if event in self.EVENTS:
            self.seconds += duration
            if event == self.EVENTS[-1]:
                self.compiles += 1

    def _event(self, event: str, **_):
        if event == "/jax/compilation_cache/cache_hits":
            self.cache_hits += 1

    @contextlib.contextmanager
    def active(self):
        import jax.monitoring as mon

        mon.register_event_duration_secs_listener(self._duration)
        mon.register_event_listener(self._event)
        try:
            yield self
        finally:
            mon.unregister_event_duration_listener(self._duration)
            mon.unregister_event_listener(self._event)

    def snapshot(self) -> tuple[float, int, int]:
        return self.seconds, self.compiles, self.cache_hits
