"""The Runner owns what lives on the device: the split model, the KV cache
and the compiled step programs.

    runner.step(batch, key[, penalties, rules]) -> StepResult (numpy)   one call per step
    runner.warm_up()                                            compile every program
    runner.copy_pages(pairs)                                    copy-on-write

Programs are compiled ahead of time from their shapes (`jax.jit(...).lower
(...).compile()`) and kept by key: one per step program (`Buckets.programs`),
one re-sampler per S for steps with token rules or penalties (one without
penalties, one per penalty history width), one page copy. `warm_up`
compiles them all up front, two at a time (XLA's CPU compiler is mostly
single-threaded); without it each compiles on first use. Either way a
program is compiled once per Runner and `compiled` lists them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import KVCache, copy_pages
from jaxkv.worker.sampler import sample_with_rules
from jaxkv.worker.step import ScoreOutput, StepOutput, score_step, step
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.step_batch import PenaltyBatch, RulesBatch, StepBatch, empty, empty_rules

# Copy-on-write pairs per page-copy call (padded with trash-to-trash pairs).
COPY_WIDTH = 64


@dataclasses.dataclass
class StepResult:
    """A step's outputs on the host, cut to the live sequences: tokens /
    logprobs [n, S_live], top_ids / top_logprobs [n, S_live, N], finite
    [n, S_live] (all that row's logits finite), n the model calls run."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    finite: np.ndarray


class Runner:
    def __init__(self, model, cache: KVCache, buckets: Buckets, attention: AttentionSpec, *,
                 max_decode_steps: int = 1, num_top_logprobs: int = 0, seed: int = 0):
        self.graphdef, state = nnx.split(model)
        self.vocab_size = model.config.vocab_size
        # Commit every array to its device up front: outputs of the step are
        # committed, and a committed/uncommitted mismatch would not match
        # the compiled programs.
        commit = functools.partial(jax.tree_util.tree_map, lambda x: jax.device_put(x, x.sharding))
        self.state = commit(state)
        self.cache = commit(cache)
        self.page_size = cache.page_size
        self.buckets = buckets
        self.attention = attention
        self.max_decode_steps = max_decode_steps
        self.num_top_logprobs = num_top_logprobs
        self.rng = jax.random.key(seed)
        self._programs: dict[Any, Any] = {}
        self._empty_rules: dict[int, RulesBatch] = {}
        self.stats = dict(calls=0, seconds=0.0)  # step() calls and their wall time

    # ------------------------------------------------------------ programs

    def program_keys(self) -> list:
        """Every program this runner can run: step programs, penalty
        samplers (per sequence bucket and history width), the page copy."""
        seqs = sorted({k.seqs for k in self.buckets.programs()})
        return (self.buckets.programs()
                + [("rules", s, n) for s in seqs for n in (0, *self.buckets.history)]
                + [("copy", COPY_WIDTH)])

    @property
    def compiled(self) -> list:
        """Keys of the programs compiled so far."""
        return list(self._programs)

    def _lower(self, key):
        """The jitted function of `key` lowered with placeholder inputs."""
        if key[0] == "score":  # (score, T, S): a prompt chunk with logits at every row
            _, T, S = key
            fn = jax.jit(functools.partial(score_step, num_top_logprobs=self.num_top_logprobs,
                                           attention=self.attention),
                         static_argnums=(0,), donate_argnums=(2,))
            batch = dataclasses.replace(empty(ProgramKey("mixed", T, S),
                                              self.buckets.pages_per_seq),
                                        logits_indices=np.zeros(T, np.int32))
            return fn.lower(self.graphdef, self.state, self.cache, batch, self.rng,
                            np.zeros(T, np.int32))
        if isinstance(key, ProgramKey):
            fn = jax.jit(functools.partial(
                step, kind=key.kind, max_steps=self.max_decode_steps if key.loops else 1,
                num_top_logprobs=self.num_top_logprobs, attention=self.attention),
                static_argnums=(0,), donate_argnums=(2,))
            batch = empty(key, self.buckets.pages_per_seq)
            return fn.lower(self.graphdef, self.state, self.cache, batch, self.rng)
        if key[0] == "rules":
            _, S, N = key
            fn = jax.jit(functools.partial(sample_with_rules,
                                           num_top_logprobs=self.num_top_logprobs))
            b = empty(ProgramKey("mixed", S, S), self.buckets.pages_per_seq)
            logits = jax.ShapeDtypeStruct((S, self.vocab_size), np.float32)
            pen = PenaltyBatch(np.zeros((S, N), np.int32), np.zeros((S, N), bool)) if N else None
            return fn.lower(logits, b.sampling, pen, empty_rules(S, self.vocab_size), self.rng,
                            b.num_output)
        idx = np.zeros(COPY_WIDTH, np.int32)
        return jax.jit(copy_pages, donate_argnums=(0,)).lower(self.cache, idx, idx)

    def _program(self, key):
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = self._lower(key).compile()
        return prog

    def warm_up(self, progress: bool | Callable[[int, int], None] = True,
                keys: Sequence | None = None, workers: int = 2) -> dict[str, Any]:
        """Compile every program (or `keys`) not compiled yet; returns
        {"programs": number compiled, "seconds": wall time}. `progress`: a
        tqdm bar, or a callback (done, total)."""
        todo = [k for k in (self.program_keys() if keys is None else keys)
                if k not in self._programs]
        t0 = time.perf_counter()
        bar = None
        if progress is True and todo:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(todo), desc="jaxkv warm-up", unit="program", dynamic_ncols=True)
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            # Tracing holds the GIL, XLA's compile does not: lower here,
            # compile in the pool.
            futures = {pool.submit(low.compile): k for k, low in ((k, self._lower(k)) for k in todo)}
            for n, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                self._programs[futures[fut]] = fut.result()
                if bar is not None:
                    bar.update(1)
                elif callable(progress):
                    progress(n, len(todo))
        if bar is not None:
            bar.close()
        return dict(programs=len(todo), seconds=time.perf_counter() - t0)

    # ------------------------------------------------------------ running

    def step(self, batch: StepBatch, key: ProgramKey, num_seqs: int,
             penalties: PenaltyBatch | None = None, rules: RulesBatch | None = None
             ) -> StepResult:
        """Run one step (a mixed step, or `batch.num_steps` decode steps);
        returns the first `num_seqs` sequences' outputs as numpy. With
        `penalties` or `rules`, every sequence's token is drawn again from
        the last logits with them applied (the engine runs such steps one
        decode step at a time)."""
        t0 = time.perf_counter()
        first = batch
        if rules is not None or penalties is not None:  # its draw is redone: make it cheap
            S = batch.sampling.temperature.shape[0]
            first = dataclasses.replace(batch, sampling=dataclasses.replace(
                batch.sampling, temperature=np.zeros(S, np.float32),
                num_logprobs=np.zeros(S, np.int32)))
        out, self.cache = self._program(key)(self.state, self.cache, first, self.rng)
        out: StepOutput
        fields = (out.tokens, out.logprobs, out.top_ids, out.top_logprobs, out.finite)
        if rules is not None or penalties is not None:
            fields = self._resample(out, batch.sampling, batch.num_output, penalties, rules)
        n = int(out.steps)
        res = StepResult(*(np.asarray(x)[:n, :num_seqs] for x in fields))
        self.stats["calls"] += 1
        self.stats["seconds"] += time.perf_counter() - t0
        return res

    def score(self, batch: StepBatch, key: ProgramKey, targets: np.ndarray,
              penalties: PenaltyBatch | None = None, rules: RulesBatch | None = None):
        """Run one sequence's prompt chunk (`batch` as build_step_batch made
        it for that sequence alone; `penalties` / `rules` of one row) with
        logits at every row: returns
        (target_logprobs [T], top_ids [T, N], top_logprobs [T, N], StepResult
        of the last row's sample) as numpy. Compiled on first use (not part
        of warm-up)."""
        T = key.tokens
        batch = dataclasses.replace(batch, logits_indices=np.arange(T, dtype=np.int32))
        out, self.cache = self._program(("score", T, key.seqs))(self.state, self.cache, batch,
                                                               self.rng, targets)
        out: ScoreOutput
        st = out.step
        fields = (st.tokens, st.logprobs, st.top_ids, st.top_logprobs, st.finite)
        if rules is not None or penalties is not None:  # one row: the sequence's
            sb = jax.tree_util.tree_map(lambda x: x[:1], batch.sampling)
            fields = self._resample(st, sb, batch.num_output[:1], penalties, rules)
        res = StepResult(*(np.asarray(x) for x in fields))
        self.stats["calls"] += 1
        return (np.asarray(out.target_logprobs), np.asarray(out.top_ids),
                np.asarray(out.top_logprobs), res)

    def _resample(self, out: StepOutput, sampling, num_output, penalties, rules) -> tuple:
        """Draw each sequence's token again from `out`'s last logits with the
        token rules (all allowed when None) and penalties applied; the
        fields of a one-step StepResult."""
        S = out.logits.shape[0]
        N = penalties.history.shape[1] if penalties is not None else 0
        redo = self._program(("rules", S, N))(
            out.logits, sampling, penalties, rules if rules is not None else self._no_rules(S),
            self.rng, num_output)
        return tuple(np.asarray(x)[None] for x in
                     (redo.token_ids, redo.logprob, redo.top_ids, redo.top_logprobs)
                     ) + (out.finite,)

    def _no_rules(self, num_seqs: int) -> RulesBatch:
        """All tokens allowed, no bias (steps with penalties only), kept on
        the device per sequence bucket."""
        rb = self._empty_rules.get(num_seqs)
        if rb is None:
            rb = self._empty_rules[num_seqs] = jax.device_put(
                empty_rules(num_seqs, self.vocab_size))
        return rb

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device-side copy-on-write: copy page src -> dst for each pair."""
        prog = self._program(("copy", COPY_WIDTH)) if pairs else None
        for i in range(0, len(pairs), COPY_WIDTH):
            chunk = list(pairs[i:i + COPY_WIDTH])
            src = np.zeros(COPY_WIDTH, np.int32)
            dst = np.zeros(COPY_WIDTH, np.int32)
            src[:len(chunk)] = [p[0] for p in chunk]
            dst[:len(chunk)] = [p[1] for p in chunk]
            self.cache = prog(self.cache, src, dst)
