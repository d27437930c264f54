"""The Runner owns what lives on the device: the split model, the KV cache
and the compiled step programs.

    runner.step(batch, key[, penalties, rules]) -> StepResult (numpy)   one call per step
    runner.dispatch(...) -> Pending; runner.fetch(pending) -> StepResult  the same, split
    runner.warm_up()                                            compile every program
    runner.copy_pages(pairs)                                    copy-on-write
    runner.follow()                                             processes 1..n-1

Programs are compiled ahead of time from their shapes (`jax.jit(...).lower
(...).compile()`) and kept by key: one per step program (`Buckets.programs`),
one re-sampler per S for steps with token rules or penalties (one without
penalties, one per penalty history width), one page copy. `warm_up`
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
import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv.model.attention import AttentionSpec
from jaxkv.sharding import to_host
from jaxkv.model.kv_cache import KVCache, copy_pages
from jaxkv.worker.sampler import sample_with_rules
from jaxkv.worker.distributed import Follower
from jaxkv.worker.step import ScoreOutput, StepOutput, forward_step, score_step, step
from jaxkv.worker.verify import verify_step
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.step_batch import PenaltyBatch, RulesBatch, StepBatch, empty, empty_rules

# Copy-on-write pairs per page-copy call (padded with trash-to-trash pairs).
COPY_WIDTH = 64


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


class Runner(Follower):
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

    def _jit(self, fn, args: str, out: str, donate: tuple = ()):
        """jax.jit of `fn` whose arguments / outputs are, by letter, the
        parameters (s), the cache (c) or anything else (r: replicated)
        under a sharding plan; plain jax.jit without one."""
        if self._sh is None:
            return jax.jit(fn, donate_argnums=donate)
        pick = {"s": self._sh["state"], "c": self._sh["cache"], "r": self._sh["rep"]}
        outs = tuple(pick[c] for c in out)
        return jax.jit(fn, donate_argnums=donate, in_shardings=tuple(pick[c] for c in args),
                       out_shardings=outs[0] if len(outs) == 1 else outs)

    def lower(self, key, lowering_platforms=None):
        """The jitted function of `key` lowered with placeholder inputs
        (jax.stages.Lowered; `.compile()` it), for `lowering_platforms`
        (e.g. ("cuda",)) when given instead of this machine's."""
        g = self.graphdef
        kw = {} if lowering_platforms is None else dict(lowering_platforms=lowering_platforms)
        if key[0] == "score":  # (score, T, S): a prompt chunk with logits at every row
            _, T, S = key
            fn = self._jit(functools.partial(score_step, g, num_top_logprobs=self.num_top_logprobs,
                                             attention=self.attention), "scrrr", "rc", (1,))
            batch = dataclasses.replace(empty(ProgramKey("mixed", T, S),
                                              self.buckets.pages_per_seq),
                                        logits_indices=np.zeros(T, np.int32))
            return fn.trace(self.state, self.cache, batch, self.rng,
                            np.zeros(T, np.int32)).lower(**kw)
        if key[0] == "forward":  # ("forward", ProgramKey): K/V writes only
            fn = self._jit(functools.partial(forward_step, g, kind=key[1].kind,
                                             attention=self.attention), "scr", "c", (1,))
            batch = empty(key[1], self.buckets.pages_per_seq, self.buckets.num_spec)
            return fn.trace(self.state, self.cache, batch).lower(**kw)
        if isinstance(key, ProgramKey):
            common = dict(num_top_logprobs=self.num_top_logprobs, attention=self.attention)
            if key.kind == "verify":
                fn = functools.partial(verify_step, g, num_spec=self.buckets.num_spec, **common)
            else:
                fn = functools.partial(step, g, kind=key.kind, **common,
                                       max_steps=self.max_decode_steps if key.loops else 1)
            fn = self._jit(fn, "scrrr", "rcr", (1, 4))
            batch = empty(key, self.buckets.pages_per_seq, self.buckets.num_spec)
            return fn.trace(self.state, self.cache, batch, self.rng, self.last).lower(**kw)
        if key[0] == "rules":
            _, S, N = key
            fn = self._jit(functools.partial(sample_with_rules,
                                             num_top_logprobs=self.num_top_logprobs),
                           "rrrrrr", "r")
            b = empty(ProgramKey("mixed", S, S), self.buckets.pages_per_seq)
            logits = jax.ShapeDtypeStruct((S, self.vocab_size), np.float32)
            pen = PenaltyBatch(np.zeros((S, N), np.int32), np.zeros((S, N), bool)) if N else None
            return fn.trace(logits, b.sampling, pen, empty_rules(S, self.vocab_size), self.rng,
                            b.num_output).lower(**kw)
        idx = np.zeros(COPY_WIDTH, np.int32)
        return self._jit(copy_pages, "crr", "c", (0,)).trace(self.cache, idx, idx).lower(**kw)

    def _program(self, key):
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = self.lower(key).compile()
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
            futures = {pool.submit(low.compile): k for k, low in ((k, self.lower(k)) for k in todo)}
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
