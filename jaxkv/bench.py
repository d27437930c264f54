"""Generation benchmarks: jaxkv on the default model, optionally against
Hugging Face transformers on the same GGUF, in the same process.

    python scripts/bench.py [--peer hf] [--json out.json] [--quick] [--runs N]
    jaxkv bench ...                                     (same options)

Phases (fixed prompts cut from one built-in text; greedy with the end token
ignored, so every run of a phase does the same work):

- decode: B requests with a P-token prompt go through the jaxkv engine;
  once every one has its first token (prefill done, untimed) the engine is
  timed while each sequence decodes N more tokens (pure decode at batch B,
  whatever the engine does for that: one step per call or several), then
  the requests are aborted. HF prefills the same prompts as one batch once
  (untimed) and runs a manual greedy loop of N steps on a copy of that
  cache. tok/s = tokens decoded / time. Also: bytes read per second
  (weights once per step + every sequence's live K/V) against the measured
  memory bandwidth, and the engine's host time per step.
- prefill: one request of n prompt tokens, max_tokens 1, through the
  engine (chunked at max_num_batched_tokens like any request); HF runs one
  forward with logits at the last row only. tok/s = n / time to the first
  token, which is also the time-to-first-token figure.
- e2e: M requests of mixed prompt and output lengths through the engine,
  all submitted at once (batched), and the same M requests one after
  another (sequential). tok/s counts generated tokens.

Warm-up is excluded: before a phase is timed, its jaxkv workload runs once
on the host against a stand-in runner that records the shape of every
step, and one step of each distinct shape then runs for real (that is
where the compiles happen). Timed runs that still compile say so
(`new_compiles_in_timed_runs`, and a WARNING line). jaxkv and HF runs
alternate (jaxkv, hf, jaxkv, hf, ...); each figure is the median over
`--runs` runs (the long sequential e2e pass runs once). The engine runs
with its defaults (prefix caching on) except the pool size; each
submission swaps the first prompt token for a fresh one so no run reuses
another's cached pages. The JSON holds every run's value, versions, the
CPU, the load average before and after (other processes skew CPU timings:
compare runs taken under similar load) and the HF thread choice.

JSON layout (ratio = jaxkv / hf for throughput, hf / jaxkv for latency, so
> 1 means jaxkv is faster):

    results["decode"]["batch16"]["jaxkv"]["tok_per_s"], ...["hf"]..., ...["ratio"]
    results["prefill"]["tokens256"]["jaxkv"]["tok_per_s"], ...["ttft_ms"]
    results["e2e"]["batched"]["jaxkv"]["tok_per_s"], results["e2e"]["sequential"]...,
        results["e2e"]["ratio_batched_over_sequential"]
    results["ttft"]["prompt256"]["jaxkv"]["ms"], results["ttft"]["e2e_batched"]...
    results["bandwidth"]["read_bytes_per_s"], results["compile"]["programs"], ...
    results["goals"] = [{"name", "value", "target", "met"}, ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jaxkv.bench_hf import DEFAULT_MODEL, HFBench
from jaxkv.bench_report import evaluate_goals, format_report  # noqa: F401 (re-exported)

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
    prefill_lens: tuple[int, ...] = (256, 1024)
    e2e_requests: int = 64
    e2e_prompt: tuple[int, int] = (16, 128)
    e2e_output: tuple[int, int] = (8, 40)
    sequential_runs: int = 1  # the sequential pass is long; its many steps average well
    bandwidth_bytes: int = 1 << 30


FULL = Sizes()
QUICK = Sizes(decode_steps=8, prefill_lens=(256,), e2e_requests=16, e2e_output=(4, 16),
              bandwidth_bytes=256 << 20)


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
        out.append(doubled[off:off + n])
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
    return dict(array_bytes=nbytes, repeats=repeats, threads=k,
                numpy_sum_1thread_bytes_per_s=one_m, numpy_sum_threads_bytes_per_s=multi_m,
                blas_gemv_bytes_per_s=gemv_m, read_bytes_per_s=max(one_m, multi_m, gemv_m),
                runs_1thread=one, runs_threads=multi, runs_gemv=gemv)


class CompileMeter:
    """Counts and times jax compiles (jax.monitoring events) while active.
    A compile served by the persistent compilation cache (the engine turns
    it on) counts as a cache hit and costs only its retrieval."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

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


# ------------------------------------------------------------------ jaxkv


def _stand_in(seqs) -> list:
    """Copies of `seqs` with the same shapes whose rows all write to the
    trash page 0."""
    from jaxkv.runner import SeqInput
    return [SeqInput([0] * len(s.token_ids), s.start_pos, [0] * len(s.block_table),
                     temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                     presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                     repetition_penalty=s.repetition_penalty, history=[0] * len(s.history),
                     num_prompt=s.num_prompt) for s in seqs]


class _ShapeRecorder:
    """Stands in for the Runner during a host-only dry run of the engine:
    keeps one trash-page stand-in call per distinct batch shape and answers
    with a fixed token. `replay` then runs each of them once for real."""

    def __init__(self, runner, token: int):
        self.page_size, self.buckets, self.token = runner.page_size, runner.buckets, token
        self.calls: dict[tuple, tuple[str, tuple, dict]] = {}
        self.compiles = 0

    def _key(self, seqs, extra: tuple, **build_kw) -> tuple:
        import jax
        from jaxkv.runner import build_batch

        batch, greedy = build_batch(seqs, self.page_size, self.buckets, **build_kw)
        return (tuple(np.shape(x) for x in jax.tree_util.tree_leaves(batch)), greedy) + extra

    def copy_pages(self, pairs) -> None:
        pass

    def run(self, seqs, *, num_top_logprobs: int = 0, return_logits: bool = False):
        from jaxkv.sampling import SampleOutput

        kw = dict(num_top_logprobs=num_top_logprobs, return_logits=return_logits)
        key = self._key(seqs, ("run", num_top_logprobs, return_logits))
        self.calls.setdefault(key, ("run", (_stand_in(seqs),), kw))
        n, k = len(seqs), num_top_logprobs
        out = SampleOutput(token_ids=np.full(n, self.token, np.int32),
                           logprob=np.zeros(n, np.float32), top_ids=np.zeros((n, k), np.int32),
                           top_logprobs=np.zeros((n, k), np.float32))
        return out, (np.zeros((n, 1), np.float32) if return_logits else None)

    def run_decode(self, seqs, stops, num_steps: int, *, num_top_logprobs: int = 0):
        """The engine's multi-step decode call (where the Runner has one)."""
        kw = dict(num_top_logprobs=num_top_logprobs)
        key = self._key(seqs, ("run_decode", num_steps, num_top_logprobs,
                               max([len(s[0]) for s in stops] + [0])), decode_steps=num_steps)
        # One step is enough to compile it (num_steps is static).
        one_step = [(s[0], s[1], 1) for s in stops]
        self.calls.setdefault(key, ("run_decode", (_stand_in(seqs), one_step, num_steps), kw))
        n = max(1, min(num_steps, max(int(s[2]) for s in stops)))
        m, k = len(seqs), num_top_logprobs
        return (np.full((n, m), self.token, np.int32), np.zeros((n, m), np.float32),
                np.zeros((n, m, k), np.int32), np.zeros((n, m, k), np.float32))

    def replay(self, runner) -> None:
        for method, args, kw in self.calls.values():
            getattr(runner, method)(*args, **kw)


class _TimedRunner:
    """Wraps the Runner to time its device calls (`run`, `run_decode`,
    batch building included); engine time outside them is host overhead."""

    TIMED = ("run", "run_decode")

    def __init__(self, runner):
        self._runner = runner
        self.seconds, self.calls = 0.0, 0

    def __getattr__(self, name):
        attr = getattr(self._runner, name)
        if name not in self.TIMED:
            return attr

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = attr(*args, **kwargs)
            self.seconds += time.perf_counter() - t
            self.calls += 1
            return out

        return timed


@dataclasses.dataclass
class Req:
    prompt: list[int]
    max_tokens: int


class JaxkvBench:
    """jaxkv through its engine, default settings but the pool size.

    Every workload submission replaces the first token of each prompt by a
    fresh "salt" token, so the prefix cache (on, as by default) never serves
    one run from pages another run computed; within a run prompts share no
    page. Token counts stay the same."""

    # Decode requests have this many tokens to spare after the timed
    # window (they are aborted at its end, never finish inside it).
    DECODE_MARGIN = 64

    def __init__(self, model: str, sizes: Sizes, meter: CompileMeter,
                 quantize: str | None = None):
        import jax
        import jax.numpy as jnp
        from jaxkv.engine import LLMEngine

        self.sizes = sizes
        self.meter = meter
        e2e_p, e2e_o = e2e_lengths(sizes)
        ps = 16
        pages = lambda n: -(-n // ps)  # noqa: E731
        need = max(max(sizes.decode_batches) * pages(sizes.decode_prompt + sizes.decode_steps
                                                     + self.DECODE_MARGIN),
                   sum(pages(p + o) for p, o in zip(e2e_p, e2e_o)),
                   max((pages(n + 1) for n in sizes.prefill_lens), default=1))
        t, self.engine = _timed(lambda: LLMEngine.from_pretrained(
            model, page_size=ps, num_pages=need + 2, quantize=quantize,
            max_num_seqs=max(64, *sizes.decode_batches)))
        self.load_s = t
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.model_config
        self.stream = prompt_stream(self.tokenizer, self.config.vocab_size,
                                    max([sizes.decode_prompt, *sizes.prefill_lens,
                                         sizes.e2e_prompt[1]]))
        self._salts = sorted(set(self.stream))
        self._submissions = 0
        # Bytes a batch-1 step reads (w8a8 keeps float weights for small steps
        # beside int8 ones for large: count only the float ones).
        self.weight_bytes = sum(
            x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(self.runner.state)
            if "w8" not in jax.tree_util.keystr(path))
        if not self.config.tie_word_embeddings:  # embedding rows are gathered, not read whole
            self.weight_bytes -= (self.config.vocab_size * self.config.hidden_size
                                  * jnp.dtype(self.engine.config.dtype).itemsize)
        cache = self.runner.cache
        self.kv_bytes_per_token = cache.nbytes() // (cache.num_pages * cache.page_size)

    @property
    def runner(self):
        return self.engine.runner

    def _salted(self, prompts: list[list[int]]) -> list[list[int]]:
        self._submissions += 1
        salt = self._salts[self._submissions % len(self._salts)]
        return [[salt] + list(p[1:]) for p in prompts]

    # -------------------------------------------------------------- warm-up

    def warm_up(self, workload: Callable[[], Any]) -> dict[str, Any]:
        """Dry-run `workload` on the host, then run one stand-in step of
        every batch shape it produced, so the timed runs find every program
        compiled."""
        eng = self.engine
        real, stats = eng.runner, dict(eng.stats)
        rec = _ShapeRecorder(real, token=self._salts[0])
        eng.runner = rec
        try:
            workload()
        finally:
            eng.runner = real
            eng.stats = stats
        return dict(shapes=len(rec.calls), **self.compiling(lambda: rec.replay(real)))

    def compiling(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """Run `fn`; report the step programs and XLA compiles it caused."""
        c0 = self.runner.compiles
        s0, n0, h0 = self.meter.snapshot()
        t, _ = _timed(fn)
        s1, n1, h1 = self.meter.snapshot()
        return dict(new_programs=self.runner.compiles - c0, xla_compiles=n1 - n0,
                    cache_hits=h1 - h0, compile_s=s1 - s0, wall_s=t)

    # -------------------------------------------------------------- engine

    def _params(self, max_tokens: int):
        from jaxkv.sequence import SamplingParams
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def _submit(self, prompts: list[list[int]], max_tokens: list[int]) -> list[str]:
        return [self.engine.add_request({"prompt_token_ids": p}, self._params(m))
                for p, m in zip(self._salted(prompts), max_tokens)]

    def decode_run(self, prompts: list[list[int]], steps: int) -> dict[str, Any]:
        """Prefill `prompts` (untimed), then time the engine while every
        sequence decodes `steps` more tokens (pure decode at batch
        len(prompts)); the requests are aborted afterwards."""
        eng = self.engine
        rids = self._submit(prompts, [steps + self.DECODE_MARGIN] * len(prompts))
        seqs = [eng.get_request(r) for r in rids]
        while any(not s.output_token_ids for s in seqs):
            eng.step()
        start = [len(s.output_token_ids) for s in seqs]
        ctx = sum(s.num_tokens for s in seqs)
        timed = _TimedRunner(eng.runner)
        real, eng.runner = eng.runner, timed
        c0 = real.compiles
        try:
            t0 = time.perf_counter()
            while min(len(s.output_token_ids) - n for s, n in zip(seqs, start)) < steps:
                eng.step()
            wall = time.perf_counter() - t0
        finally:
            eng.runner = real
        if any(s.finished for s in seqs):
            raise RuntimeError("a decode request finished inside the timed window")
        tokens = sum(len(s.output_token_ids) - n for s, n in zip(seqs, start))
        for r in rids:
            eng.abort(r)
        eng.step()
        B = len(prompts)
        return dict(seconds=wall, tokens=tokens, engine_steps=timed.calls, runner_s=timed.seconds,
                    new_compiles=real.compiles - c0,
                    # live K/V tokens per decode step, averaged over the window
                    kv_tokens_per_step=ctx + tokens / 2 - B / 2)

    def engine_run(self, reqs: list[Req], *, sequential: bool) -> dict[str, Any]:
        """All requests at once (or one after another); returns wall time,
        token counts, per-request time to first token and engine host time."""
        eng = self.engine
        timed = _TimedRunner(eng.runner)
        real, eng.runner = eng.runner, timed
        c0 = real.compiles
        prompts = self._salted([r.prompt for r in reqs])
        params = [self._params(r.max_tokens) for r in reqs]
        outs = []
        try:
            t0 = time.perf_counter()
            if sequential:
                for p, sp in zip(prompts, params):
                    rid = eng.add_request({"prompt_token_ids": p}, sp)
                    outs.append(eng.run_to_completion([rid])[rid])
            else:
                rids = [eng.add_request({"prompt_token_ids": p}, sp)
                        for p, sp in zip(prompts, params)]
                final = eng.run_to_completion(rids)
                outs = [final[rid] for rid in rids]
            wall = time.perf_counter() - t0
        finally:
            eng.runner = real
        for o, r in zip(outs, reqs):
            if len(o.outputs[0].token_ids) != r.max_tokens:
                raise RuntimeError(f"request {o.request_id}: {len(o.outputs[0].token_ids)} tokens, "
                                   f"expected {r.max_tokens} ({o.outputs[0].finish_reason})")
        ttft = [o.metrics["first_token"] - o.metrics["arrival"] for o in outs]
        return dict(wall_s=wall, output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
                    prompt_tokens=sum(len(r.prompt) for r in reqs), ttft_s=ttft,
                    engine_steps=timed.calls, runner_s=timed.seconds,
                    new_compiles=real.compiles - c0)


def jaxkv_model_source(model: str) -> str:
    """The default model is read from its GGUF, the file HF reads too."""
    if model.lower() == DEFAULT_MODEL:
        from jaxkv.default_model import fetch_smollm2_gguf
        return str(fetch_smollm2_gguf())
    return model


# ------------------------------------------------------------------ phases


def _entry(measured: list[tuple[float, int]], **extra) -> dict[str, Any]:
    """A figure from (seconds, tokens) per run: the median rate."""
    rates = [n / t for t, n in measured]
    return dict(tok_per_s=_median(rates), seconds=_median([t for t, _ in measured]),
                tokens=int(_median([n for _, n in measured])),
                runs_seconds=[t for t, _ in measured], runs_tokens=[n for _, n in measured],
                runs_tok_per_s=rates, **extra)


def _median_run(runs: list[dict], rate: Callable[[dict], float]) -> dict:
    """The run with the median rate (the lower middle one for an even count)."""
    order = sorted(runs, key=rate)
    return order[(len(order) - 1) // 2]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def run_benchmarks(model: str = DEFAULT_MODEL, *, peer: str | None = None,
                   sizes: Sizes = FULL, runs: int = 3, cold_compile: bool = False,
                   quantize: str | None = None, log=print) -> dict[str, Any]:
    """Run every phase; returns the results dict (see the module docstring).
    `cold_compile` turns JAX's persistent compilation cache off, so every
    program compiles from scratch as on a machine that never ran jaxkv."""
    import jax

    if runs < 1:
        raise ValueError(f"runs: must be >= 1, got {runs}")
    if cold_compile:
        jax.config.update("jax_enable_compilation_cache", False)
    t_start = time.perf_counter()
    meter = CompileMeter()
    res: dict[str, Any] = dict(meta=dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        model=model, peer=peer, runs=runs, quantize=quantize, sizes=dataclasses.asdict(sizes),
        cpu=_cpu_name(), cores=_num_cores(), platform=platform.platform(),
        python=platform.python_version(), jax=jax.__version__, numpy=np.__version__,
        jax_backend=jax.default_backend(), loadavg_start=_loadavg()))
    log(f"bench: memory bandwidth over {sizes.bandwidth_bytes >> 20} MiB ...")
    res["bandwidth"] = bw = measure_bandwidth(sizes.bandwidth_bytes)
    with meter.active():
        log(f"bench: loading {model} ...")
        jx = JaxkvBench(jaxkv_model_source(model), sizes, meter, quantize)
        hf = HFBench(model, _num_cores()) if peer == "hf" else None
        res["meta"]["jaxkv_load_s"] = jx.load_s
        res["meta"]["engine"] = {k: v for k, v in dataclasses.asdict(jx.engine.config).items()
                                 if isinstance(v, (int, float, str, bool, type(None)))}
        res["meta"]["persistent_compilation_cache"] = bool(
            jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir)
        if hf is not None:
            res["meta"]["hf_load_s"] = hf.load_s
            res["meta"].update({f"hf_{k}": v for k, v in hf.versions.items()})
        res["model"] = dict(weight_bytes=jx.weight_bytes, kv_bytes_per_token=jx.kv_bytes_per_token,
                            num_layers=jx.config.num_layers, vocab_size=jx.config.vocab_size)
        warm: dict[str, Any] = {}
        res["decode"] = _decode_phase(jx, hf, sizes, runs, bw, warm, log)
        res["prefill"] = _prefill_phase(jx, hf, sizes, runs, warm, log)
        res["e2e"] = _e2e_phase(jx, sizes, runs, warm, log)
    res["ttft"] = _ttft(res)
    res["compile"] = dict(programs=jx.runner.compiles, xla_compiles=meter.compiles,
                          cache_hits=meter.cache_hits, seconds=meter.seconds,
                          warm_up_s=sum(w["wall_s"] for w in warm.values()), warm_up=warm)
    res["goals"] = evaluate_goals(res)
    res["meta"]["loadavg_end"] = _loadavg()
    res["meta"]["total_s"] = time.perf_counter() - t_start
    return res


def _decode_phase(jx: JaxkvBench, hf: HFBench | None, sizes: Sizes, runs: int, bw: dict,
                  warm: dict, log) -> dict[str, Any]:
    P, N = sizes.decode_prompt, sizes.decode_steps
    prompts = make_prompts(jx.stream, [P] * max(sizes.decode_batches))
    out: dict[str, Any] = {}
    for B in sizes.decode_batches:
        log(f"bench: decode batch {B}: warm-up ...")
        warm[f"decode_batch{B}"] = jx.warm_up(lambda: jx.decode_run(prompts[:B], N))
        hf_state = None
        if hf is not None and B in sizes.hf_decode_batches:
            hf_state = hf.decode_setup(prompts[:B])
            hf.decode_run(hf_state, 2)
        jr, ht = [], []
        for r in range(runs):
            jr.append(jx.decode_run(prompts[:B], N))
            if hf_state is not None:
                ht.append(hf.decode_run(hf_state, N))
            log(f"bench: decode batch {B} run {r + 1}/{runs}: jaxkv "
                f"{jr[-1]['tokens'] / jr[-1]['seconds']:.1f} tok/s"
                + (f", hf {B * N / ht[-1]:.1f} tok/s" if ht else ""))
        m = _median_run(jr, lambda x: x["tokens"] / x["seconds"])
        steps = m["tokens"] / B
        # Each decode step reads the weights once and every sequence's live K/V.
        step_bytes = jx.weight_bytes + jx.kv_bytes_per_token * m["kv_tokens_per_step"]
        e = _entry([(x["seconds"], x["tokens"]) for x in jr],
                   step_ms=1e3 * m["seconds"] / steps,
                   engine_calls=m["engine_steps"],
                   host_overhead_ms_per_step=1e3 * (m["seconds"] - m["runner_s"]) / steps,
                   new_compiles_in_timed_runs=sum(x["new_compiles"] for x in jr),
                   bytes_per_step=step_bytes)
        e["bytes_per_s"] = step_bytes * steps / m["seconds"]
        e["bandwidth_fraction"] = e["bytes_per_s"] / bw["read_bytes_per_s"]
        # The bandwidth limit: one full read of weights + live K/V per step.
        e["bandwidth_limit_tok_per_s"] = B * bw["read_bytes_per_s"] / step_bytes
        entry: dict[str, Any] = dict(batch=B, prompt_tokens=P, decode_steps=N, jaxkv=e)
        if ht:
            entry["hf"] = _entry([(t, B * N) for t in ht], step_ms=1e3 * _median(ht) / N)
            entry["ratio"] = _ratio(e["tok_per_s"], entry["hf"]["tok_per_s"])
        out[f"batch{B}"] = entry
    return out


def _prefill_phase(jx: JaxkvBench, hf: HFBench | None, sizes: Sizes, runs: int, warm: dict,
                   log) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, n in enumerate(sizes.prefill_lens):
        prompt = make_prompts(jx.stream, [n] * (i + 1))[i]
        reqs = [Req(prompt, 1)]
        log(f"bench: prefill {n}: warm-up ...")
        warm[f"prefill_tokens{n}"] = jx.warm_up(lambda: jx.engine_run(reqs, sequential=False))
        if hf is not None:
            hf.prefill(prompt)
        jr, ht = [], []
        for r in range(runs):
            jr.append(jx.engine_run(reqs, sequential=False))
            if hf is not None:
                ht.append(hf.prefill(prompt))
            log(f"bench: prefill {n} run {r + 1}/{runs}: jaxkv {n / jr[-1]['ttft_s'][0]:.1f} tok/s"
                + (f", hf {n / ht[-1]:.1f} tok/s" if ht else ""))
        jt = [x["ttft_s"][0] for x in jr]
        e = _entry([(t, n) for t in jt], ttft_ms=1e3 * _median(jt),
                   new_compiles_in_timed_runs=sum(x["new_compiles"] for x in jr))
        entry: dict[str, Any] = dict(batch=1, prompt_tokens=n, jaxkv=e)
        if ht:
            entry["hf"] = _entry([(t, n) for t in ht], ttft_ms=1e3 * _median(ht))
            entry["ratio"] = _ratio(e["tok_per_s"], entry["hf"]["tok_per_s"])
        out[f"tokens{n}"] = entry
    return out


def _e2e_phase(jx: JaxkvBench, sizes: Sizes, runs: int, warm: dict, log) -> dict[str, Any]:
    plens, olens = e2e_lengths(sizes)
    reqs = [Req(p, o) for p, o in zip(make_prompts(jx.stream, plens), olens)]
    out: dict[str, Any] = dict(num_requests=len(reqs), prompt_lens=plens, output_lens=olens)
    for mode, n_runs in (("batched", runs), ("sequential", min(runs, sizes.sequential_runs))):
        seq = mode == "sequential"
        log(f"bench: e2e {mode}: warm-up ...")
        warm[f"e2e_{mode}"] = jx.warm_up(lambda: jx.engine_run(reqs, sequential=seq))
        rs = []
        for r in range(n_runs):
            rs.append(jx.engine_run(reqs, sequential=seq))
            log(f"bench: e2e {mode} run {r + 1}/{n_runs}: "
                f"{rs[-1]['output_tokens'] / rs[-1]['wall_s']:.1f} output tok/s, "
                f"{rs[-1]['wall_s']:.1f} s")
        m = _median_run(rs, lambda x: x["output_tokens"] / x["wall_s"])
        e = _entry([(x["wall_s"], x["output_tokens"]) for x in rs],
                   total_tok_per_s=_median([(x["output_tokens"] + x["prompt_tokens"]) / x["wall_s"]
                                            for x in rs]),
                   output_tokens=m["output_tokens"], prompt_tokens=m["prompt_tokens"],
                   engine_calls=m["engine_steps"], runs=n_runs,
                   host_overhead_s=m["wall_s"] - m["runner_s"],
                   host_overhead_ms_per_call=(1e3 * (m["wall_s"] - m["runner_s"])
                                              / m["engine_steps"]),
                   ttft_ms_median=1e3 * _median(m["ttft_s"]),
                   ttft_ms_p90=1e3 * float(np.percentile(m["ttft_s"], 90)),
                   ttft_ms_max=1e3 * max(m["ttft_s"]),
                   new_compiles_in_timed_runs=sum(x["new_compiles"] for x in rs))
        out[mode] = dict(jaxkv=e)
    out["ratio_batched_over_sequential"] = _ratio(out["batched"]["jaxkv"]["tok_per_s"],
                                                  out["sequential"]["jaxkv"]["tok_per_s"])
    return out


def _ttft(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, entry in res["prefill"].items():
        t = dict(jaxkv=dict(ms=entry["jaxkv"]["ttft_ms"]))
        if "hf" in entry:
            t["hf"] = dict(ms=entry["hf"]["ttft_ms"])
            t["ratio"] = _ratio(t["hf"]["ms"], t["jaxkv"]["ms"])
        out[key.replace("tokens", "prompt")] = t
    b = res["e2e"]["batched"]["jaxkv"]
    out["e2e_batched"] = dict(jaxkv=dict(ms_median=b["ttft_ms_median"], ms_p90=b["ttft_ms_p90"],
                                         ms_max=b["ttft_ms_max"]))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxkv bench", description="Generation benchmarks (decode, prefill, end to end); "
        "prints a markdown table and optionally writes JSON.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="model name or path (a GGUF file or Hugging Face folder for --peer hf) "
                        "(default: %(default)s, read from its GGUF)")
    p.add_argument("--peer", choices=["hf"], default=None,
                   help="also run Hugging Face transformers (torch CPU, float32) on the same "
                        "weights, interleaved with jaxkv, and print the ratios")
    p.add_argument("--json", metavar="PATH", default=None, help="write the results here")
    p.add_argument("--quick", action="store_true",
                   help="smaller workloads (8 decode steps, prefill 256 only, 16 e2e requests)")
    p.add_argument("--runs", type=int, default=3,
                   help="timed runs per figure (default: %(default)s)")
    p.add_argument("--quantize", choices=["int8", "w8a8"], default=None,
                   help="jaxkv weight format (default: float32; see jaxkv generate --help)")
    p.add_argument("--cold-compile", action="store_true",
                   help="turn JAX's persistent compilation cache off: compile times as on a "
                        "machine that never ran jaxkv")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.runs < 1:
        _parser().error("--runs must be >= 1")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    res = run_benchmarks(a.model, peer=a.peer, sizes=QUICK if a.quick else FULL, runs=a.runs,
                         cold_compile=a.cold_compile, quantize=a.quantize, log=log)
    print(format_report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=float) + "\n")
        log(f"bench: wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
