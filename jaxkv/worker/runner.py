"""The Runner owns what lives on the device: the split model, the KV cache
and the compiled step programs.

    runner.step(batch, key[, penalties, rules]) -> StepResult (numpy)   one call per step
    runner.dispatch(...) -> Pending; runner.fetch(pending) -> StepResult  the same, split
    runner.warm_up()                                            compile every program
    runner.copy_pages(pairs)                                    copy-on-write
    runner.follow()                                             processes 1..n-1

Programs (`jaxkv.worker.programs`) are compiled ahead of time from their
shapes (`jax.jit(...).lower(...).compile()`) and kept by key. `warm_up`
compiles them all up front, two at a time (XLA's CPU compiler is mostly
single-threaded); without it each compiles on first use. Either way a
program is compiled once per Runner and `compiled` lists them.

Under a `jaxkv.sharding.ShardingPlan` every program is jitted with its
shardings: the parameters and the cache as placed, everything else (batch,
sampler inputs, outputs) replicated, the cache donated and returned with
the same sharding, so it stays in place on each device. `dispatch` only
enqueues a step (JAX runs it asynchronously), so the host may build and
dispatch the next step before it `fetch`es this one's tokens; the step
programs pass each sequence's newest token to the next on the device
(`last`, see `jaxkv.worker.step`). With a
`jaxkv.worker.distributed.Channel` (several processes), process 0's step,
score and copy_pages calls are sent to the other processes first, whose
`follow()` runs the same calls on their own Runner.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv.model.attention import AttentionSpec
from jaxkv.sharding import to_host
from jaxkv.model.kv_cache import KVCache
from jaxkv.worker.distributed import Follower
from jaxkv.worker.programs import COPY_WIDTH, Programs
from jaxkv.worker.step import ScoreOutput, StepOutput
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.step_batch import PenaltyBatch, RulesBatch, StepBatch, empty_rules


@dataclasses.dataclass
class StepResult:
    """A step's outputs on the host, cut to the live sequences: tokens /
    logprobs [n, S_live], top_ids / top_logprobs [n, S_live, N], finite
    [n, S_live] (all that row's logits finite), n the model calls run (or
    k + 1 in a verify step); counts [S_live] the rows that are each
    sequence's tokens (n, or its accepted proposals plus one)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    finite: np.ndarray
    counts: np.ndarray


@dataclasses.dataclass
class Pending:
    """A dispatched step whose outputs are still on the device."""

    out: Any  # StepOutput
    fields: tuple  # (tokens, logprobs, top_ids, top_logprobs, finite), re-sampled if need be
    num_seqs: int
    t0: float


class Runner(Follower, Programs):
    def __init__(self, model, cache: KVCache, buckets: Buckets, attention: AttentionSpec, *,
                 max_decode_steps: int = 1, num_top_logprobs: int = 0, seed: int = 0,
                 plan=None, channel=None):
        self.graphdef, state = nnx.split(model)
        self.vocab_size = model.config.vocab_size
        self.channel = channel
        self._following = self._stopped = False
        if channel is not None and channel.leader:  # the followers wait for a stop
            atexit.register(self.stop_followers)
        if plan is None:
            self.rng = jax.random.key(seed)
            # Commit every array to its device up front: outputs of the step
            # are committed, and a committed/uncommitted mismatch would not
            # match the compiled programs.
            commit = functools.partial(jax.tree_util.tree_map,
                                       lambda x: jax.device_put(x, x.sharding))
            self.state, self.cache = commit(state), commit(cache)
            self._sh = None
        else:  # placed by jaxkv.sharding already (or abstract, to compile ahead of time)
            self.state, self.cache = state, cache
            if isinstance(jax.tree_util.tree_leaves(state)[0], jax.ShapeDtypeStruct):
                key = jax.eval_shape(lambda: jax.random.key(seed))
                self.rng = jax.ShapeDtypeStruct((), key.dtype, sharding=plan.replicated)
            else:  # made in place: a single-device array cannot move to other processes' devices
                self.rng = jax.jit(lambda: jax.random.key(seed), out_shardings=plan.replicated)()
            shardings = functools.partial(jax.tree_util.tree_map, lambda x: x.sharding)
            self._sh = dict(state=shardings(state), cache=shardings(cache), rep=plan.replicated)
        self.page_size = cache.page_size
        self.buckets = buckets
        # Each sequence's newest sampled token, by its index in the last step.
        width = max(k.seqs for k in buckets.programs())
        if self._sh is None:
            self.last = jax.device_put(np.zeros(width, np.int32),
                                       jax.tree_util.tree_leaves(self.cache)[0].sharding)
        elif isinstance(self.rng, jax.ShapeDtypeStruct):
            self.last = jax.ShapeDtypeStruct((width,), np.int32, sharding=self._sh["rep"])
        else:
            self.last = jax.jit(lambda: jax.numpy.zeros(width, np.int32),
                                out_shardings=self._sh["rep"])()
        self.attention = attention
        self.max_decode_steps = max_decode_steps
        self.num_top_logprobs = num_top_logprobs
        self._programs: dict[Any, Any] = {}
        self._empty_rules: dict[int, RulesBatch] = {}
        # step() calls, their wall time (dispatch to outputs on the host), and
        # the part of it the host spent blocked reading them
        self.stats = dict(calls=0, seconds=0.0, wait_seconds=0.0)

    # ------------------------------------------------------------ running

    def step(self, batch: StepBatch, key: ProgramKey, num_seqs: int,
             penalties: PenaltyBatch | None = None, rules: RulesBatch | None = None
             ) -> StepResult:
        """Run one step (a mixed step, or `batch.num_steps` decode steps);
        returns the first `num_seqs` sequences' outputs as numpy. With
        `penalties` or `rules`, every sequence's token is drawn again from
        the last logits with them applied (the engine runs such steps one
        decode step at a time)."""
        return self.fetch(self.dispatch(batch, key, num_seqs, penalties, rules))

    def dispatch(self, batch: StepBatch, key: ProgramKey, num_seqs: int,
                 penalties: PenaltyBatch | None = None, rules: RulesBatch | None = None
                 ) -> Pending:
        """`step` without waiting for it: the step is enqueued on the device
        and `fetch` reads its outputs. Steps run in dispatch order (each
        takes the cache the previous one returns)."""
        self._mirror("step", batch, key, num_seqs, penalties, rules)
        t0 = time.perf_counter()
        first = batch
        if rules is not None or penalties is not None:  # its draw is redone: make it cheap
            S = batch.sampling.temperature.shape[0]
            first = dataclasses.replace(batch, sampling=dataclasses.replace(
                batch.sampling, temperature=np.zeros(S, np.float32),
                num_logprobs=np.zeros(S, np.int32)))
        out, self.cache, self.last = self._program(key)(self.state, self.cache, first, self.rng,
                                                        self.last)
        out: StepOutput
        fields = (out.tokens, out.logprobs, out.top_ids, out.top_logprobs, out.finite)
        if rules is not None or penalties is not None:
            fields = self._resample(out, batch.sampling, batch.num_output, penalties, rules)
        return Pending(out, fields, num_seqs, t0)

    def fetch(self, pending: Pending) -> StepResult:
        """Wait for a dispatched step and read its outputs to the host."""
        t0 = time.perf_counter()
        n = int(to_host(pending.out.steps))
        self.stats["wait_seconds"] += time.perf_counter() - t0
        S = pending.num_seqs
        res = StepResult(*(to_host(x)[:n, :S] for x in pending.fields),
                         counts=to_host(pending.out.counts)[:S])
        self.stats["calls"] += 1
        self.stats["seconds"] += time.perf_counter() - pending.t0
        return res

    def forward(self, batch: StepBatch, key: ProgramKey) -> None:
        """Run `batch` for its K/V writes alone (program ("forward", key))."""
        self.cache = self._program(("forward", key))(self.state, self.cache, batch)

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
        res = StepResult(*(to_host(x) for x in fields), counts=np.ones(1, np.int32))
        self.stats["calls"] += 1
        return (to_host(out.target_logprobs), to_host(out.top_ids),
                to_host(out.top_logprobs), res)

    def _resample(self, out: StepOutput, sampling, num_output, penalties, rules) -> tuple:
        """Draw each sequence's token again from `out`'s last logits with the
        token rules (all allowed when None) and penalties applied; the
        fields of a one-step StepResult."""
        S = out.logits.shape[0]
        N = penalties.history.shape[1] if penalties is not None else 0
        redo = self._program(("rules", S, N))(
            out.logits, sampling, penalties, rules if rules is not None else self._no_rules(S),
            self.rng, num_output)
        return tuple(to_host(x)[None] for x in
                     (redo.token_ids, redo.logprob, redo.top_ids, redo.top_logprobs)
                     ) + (out.finite,)

    def _no_rules(self, num_seqs: int) -> RulesBatch:
        """All tokens allowed, no bias (steps with penalties only), kept on
        the device per sequence bucket."""
        rb = self._empty_rules.get(num_seqs)
        if rb is None:
            rb = self._empty_rules[num_seqs] = jax.device_put(
                empty_rules(num_seqs, self.vocab_size),
                None if self._sh is None else self._sh["rep"])
        return rb

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device-side copy-on-write: copy page src -> dst for each pair."""
        if not pairs:
            return
        self._mirror("copy_pages", pairs)
        prog = self._program(("copy", COPY_WIDTH))
        for i in range(0, len(pairs), COPY_WIDTH):
            chunk = list(pairs[i:i + COPY_WIDTH])
            src = np.zeros(COPY_WIDTH, np.int32)
            dst = np.zeros(COPY_WIDTH, np.int32)
            src[:len(chunk)] = [p[0] for p in chunk]
            dst[:len(chunk)] = [p[1] for p in chunk]
            self.cache = prog(self.cache, src, dst)
