"""The Runner owns what lives on the device: the split model, the KV cache
and the compiled step programs. It takes one `StepPlan` per step and gives
back one `StepResult`; it never sees a request.

    runner.step(plan) -> StepResult                      one call per step
    runner.dispatch(plan) -> Pending; runner.fetch(pending) -> StepResult   the same, split
    runner.score(plan, targets) -> ScoreResult           logits at every row
    runner.forward(plan)                                 K/V writes only (a draft's mirror)
    runner.copy_pages(pairs)                             copy-on-write
    (page moves of the host tier, importance eviction: `jaxkv.worker.page_io`)
    runner.warm_up()                                     every program ready

Its collaborators come in by the constructor: `Programs` (compiled once
per key, kept on disk by a `ProgramStore`), and on process 0 of several a
`jaxkv.worker.distributed.Leader`, to which every device call is sent
first, so the other processes run the same calls on their own Runner
(`Follower.run`).

Under a `jaxkv.sharding.ShardingPlan` every program is jitted with its
shardings: the parameters and the cache as placed, everything else (batch,
sampler inputs, outputs) replicated, the cache donated and returned with
the same sharding, so it stays in place on each device. `dispatch` only
enqueues a step (JAX runs it asynchronously), so the host may build and
dispatch the next step before it `fetch`es this one's tokens; the step
programs pass each sequence's newest token to the next on the device
(`last`, see `jaxkv.worker.step`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import KVCache
from jaxkv.sharding import leaf_names, to_host
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.plan import ScoreResult, StepPlan, StepResult
from jaxkv.worker.programs import COPY_WIDTH, Programs, copy_chunks
from jaxkv.worker.step import StepOutput
from jaxkv.worker.step_batch import StepBatch, empty_rules, pack, pad_penalties, pad_rules


@dataclasses.dataclass
class Pending:
    """A dispatched step whose outputs are still on the device."""

    out: Any  # StepOutput
    fields: tuple  # (tokens, logprobs, top_ids, top_logprobs, finite), re-sampled if need be
    num_seqs: int
    t0: float
    batch: Any = None  # the packed StepBatch it ran
    key: Any = None  # its program key


def _abstract(tree):
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree,
    )


class Runner:
    def __init__(
        self,
        model,
        cache: KVCache,
        buckets: Buckets,
        attention: AttentionSpec,
        *,
        max_decode_steps: int = 1,
        num_top_logprobs: int = 0,
        seed: int = 0,
        sharding=None,
        leader=None,
        store=None,
        offload: bool = False,
    ):
        self.graphdef, state = nnx.split(model)
        self.vocab_size = model.config.vocab_size
        self.leader = leader
        width = max(k.seqs for k in buckets.programs())
        if sharding is None:
            self.rng = jax.random.key(seed)
            # Commit every array to its device up front: outputs of the step
            # are committed, and a committed/uncommitted mismatch would not
            # match the compiled programs.
            commit = functools.partial(
                jax.tree_util.tree_map, lambda x: jax.device_put(x, x.sharding)
            )
            self.state = commit(state)
            self.cache = commit(cache)
            shardings = None
            self.last = jax.device_put(
                np.zeros(width, np.int32), jax.tree_util.tree_leaves(self.cache)[0].sharding
            )
        else:  # placed by jaxkv.sharding already (or abstract, to compile ahead of time)
            self.state = state
            self.cache = cache
            rep = sharding.replicated
            if isinstance(jax.tree_util.tree_leaves(state)[0], jax.ShapeDtypeStruct):
                key = jax.eval_shape(lambda: jax.random.key(seed))
                self.rng = jax.ShapeDtypeStruct((), key.dtype, sharding=rep)
                self.last = jax.ShapeDtypeStruct((width,), np.int32, sharding=rep)
            else:  # made in place: a single-device array cannot move to other processes' devices
                self.rng = jax.jit(lambda: jax.random.key(seed), out_shardings=rep)()
                self.last = jax.jit(lambda: jax.numpy.zeros(width, np.int32), out_shardings=rep)()
            sh = functools.partial(jax.tree_util.tree_map, lambda x: x.sharding)
            shardings = dict(state=sh(state), cache=sh(cache), rep=rep)
        self.page_size = cache.page_size
        self.buckets = buckets
        self.attention = attention
        examples = dict(
            state=_abstract(self.state),
            cache=_abstract(self.cache),
            rng=_abstract(self.rng),
            last=_abstract(self.last),
        )
        if store is not None:  # the programs depend on the model's graph and every argument
            store = store.with_parts(
                graph=self.graphdef,
                arguments=examples,
                buckets=buckets,
                attention=attention.fingerprint(),
                options=(max_decode_steps, num_top_logprobs),
            )
        self.programs = Programs(
            self.graphdef,
            examples,
            buckets,
            attention,
            vocab_size=self.vocab_size,
            max_decode_steps=max_decode_steps,
            num_top_logprobs=num_top_logprobs,
            shardings=shardings,
            store=store,
            offload=offload,
        )
        self._rep = None if shardings is None else shardings["rep"]
        self._empty_rules: dict[int, Any] = {}
        # step() calls, their wall time (dispatch to outputs on the host), and
        # the part of it the host spent blocked reading them
        self.stats = dict(calls=0, seconds=0.0, wait_seconds=0.0)
        # Tokens routed to each expert, summed over layers (a mixture of experts).
        self.routed: np.ndarray | None = None
        self._routed_seen: np.ndarray | None = None

    # ------------------------------------------------------------ programs

    @property
    def compiled(self) -> list:
        return self.programs.compiled

    def lower(self, key, lowering_platforms=None):
        return self.programs.lower(key, lowering_platforms)

    def program_keys(self) -> list:
        return self.programs.keys()

    def warm_up(self, progress=True, keys: Sequence | None = None, workers: int = 2) -> dict:
        return self.programs.warm_up(progress, keys, workers)

    def key_for(self, plan: StepPlan) -> ProgramKey:
        return self.buckets.key_for(plan.num_rows, plan.num_seqs, plan.all_decode, plan.verifies)

    def pack(self, plan: StepPlan, key: ProgramKey | None = None) -> tuple[StepBatch, ProgramKey]:
        """(the padded StepBatch of `plan`, its program key)."""
        key = key or self.key_for(plan)
        return pack(
            plan, key, self.page_size, self.buckets.pages_per_seq, self.buckets.num_spec
        ), key

    def _mirror(self, method: str, *args) -> None:
        if self.leader is not None:
            self.leader.send(method, *args)

    # ------------------------------------------------------------ running

    def step(self, plan: StepPlan) -> StepResult:
        """Run one step (a mixed step, or `plan.num_steps` decode steps);
        returns the live sequences' outputs as numpy. With penalties or
        token rules, every sequence's token is drawn again from the last
        logits with them applied (such steps run one decode step)."""
        return self.fetch(self.dispatch(plan))

    def dispatch(self, plan: StepPlan) -> Pending:
        """`step` without waiting for it: the step is enqueued on the device
        and `fetch` reads its outputs. Steps run in dispatch order (each
        takes the cache the previous one returns)."""
        self._mirror("step", plan)
        t0 = time.perf_counter()
        batch, key = self.pack(plan)
        redraw = plan.rules is not None or plan.penalties is not None
        first = batch
        if redraw:  # its draw is redone: make it cheap
            S = key.seqs
            first = dataclasses.replace(
                batch,
                sampling=dataclasses.replace(
                    batch.sampling,
                    temperature=np.zeros(S, np.float32),
                    num_logprobs=np.zeros(S, np.int32),
                ),
            )
        out, self.cache, self.last = self.programs.get(key)(
            self.state, self.cache, first, self.rng, self.last
        )
        out: StepOutput
        fields = (out.tokens, out.logprobs, out.top_ids, out.top_logprobs, out.finite)
        if redraw:
            fields = self._resample(out, batch.sampling, batch.num_output, plan, key.seqs)
        return Pending(out, fields, plan.num_seqs, t0, batch, key)

    def fetch(self, pending: Pending) -> StepResult:
        """Wait for a dispatched step and read its outputs to the host."""
        t0 = time.perf_counter()
        n = int(to_host(pending.out.steps))
        self.stats["wait_seconds"] += time.perf_counter() - t0
        S = pending.num_seqs
        res = StepResult(
            *(to_host(x)[:n, :S] for x in pending.fields), counts=to_host(pending.out.counts)[:S]
        )
        if pending.out.routed is not None:
            self._count_routed(to_host(pending.out.routed))
        self.stats["calls"] += 1
        self.stats["seconds"] += time.perf_counter() - pending.t0
        return res

    def _count_routed(self, now: np.ndarray) -> None:
        """Adds the routed counts since the last read (the cache's counters
        wrap at 2**32, so the difference modulo 2**32) to `routed`."""
        now = now.astype(np.uint32)
        if self._routed_seen is not None:
            self.routed += (now - self._routed_seen).astype(np.int64)  # uint32: modulo 2**32
        else:
            self.routed = now.astype(np.int64)
        self._routed_seen = now

    def forward(self, plan: StepPlan, key: ProgramKey | None = None) -> None:
        """Run `plan` for its K/V writes alone (program ("forward", key));
        `key` the target's program when a draft mirrors it."""
        self._mirror("forward", plan, key)
        batch, key = self.pack(plan, key)
        self.cache = self.programs.get(("forward", key))(self.state, self.cache, batch)

    def score(self, plan: StepPlan, targets: np.ndarray) -> ScoreResult:
        """Run one sequence's prompt chunk with logits at every row; row r's
        target log-probability is that of targets[r]. Compiled on first use
        (not part of warm-up)."""
        self._mirror("score", plan, targets)
        key = self.key_for(plan)
        batch, key = self.pack(plan, key)
        T = key.tokens
        batch = dataclasses.replace(batch, logits_indices=np.arange(T, dtype=np.int32))
        tg = np.zeros(T, np.int32)
        tg[: len(targets)] = targets
        out, self.cache = self.programs.get(("score", T, key.seqs))(
            self.state, self.cache, batch, self.rng, tg
        )
        st = out.step
        fields = (st.tokens, st.logprobs, st.top_ids, st.top_logprobs, st.finite)
        if plan.rules is not None or plan.penalties is not None:  # one row: the sequence's
            sb = jax.tree_util.tree_map(lambda x: x[:1], batch.sampling)
            fields = self._resample(st, sb, batch.num_output[:1], plan, 1)
        res = StepResult(*(to_host(x) for x in fields), counts=np.ones(1, np.int32))
        self.stats["calls"] += 1
        n = plan.num_rows
        return ScoreResult(
            to_host(out.target_logprobs)[:n],
            to_host(out.top_ids)[:n],
            to_host(out.top_logprobs)[:n],
            res,
        )

    def _resample(self, out: StepOutput, sampling, num_output, plan: StepPlan, rows: int) -> tuple:
        """Draw each sequence's token again from `out`'s last logits with the
        plan's token rules (all allowed when None) and penalties applied;
        the fields of a one-step StepResult."""
        pen = pad_penalties(plan.penalties, rows) if plan.penalties is not None else None
        rules = (
            pad_rules(plan.rules, rows, self.vocab_size)
            if plan.rules is not None
            else self._no_rules(rows)
        )
        N = pen.history.shape[1] if pen is not None else 0
        redo = self.programs.get(("rules", rows, N))(
            out.logits, sampling, pen, rules, self.rng, num_output
        )
        return tuple(
            to_host(x)[None]
            for x in (redo.token_ids, redo.logprob, redo.top_ids, redo.top_logprobs)
        ) + (out.finite,)

    def _no_rules(self, num_seqs: int):
        """All tokens allowed, no bias (steps with penalties only), kept on
        the device per sequence bucket."""
        rb = self._empty_rules.get(num_seqs)
        if rb is None:
            rb = self._empty_rules[num_seqs] = jax.device_put(
                empty_rules(num_seqs, self.vocab_size), self._rep
            )
        return rb

    def set_lora(self, arrays: dict) -> None:
        """Replace the LoRA slots' arrays (`jaxkv.model.lora.LoRAStack`:
        name -> [L, ...] as stored, layer l's the array of `layers[l]`):
        each placed like the array it replaces, so no program compiles;
        steps in flight keep the old ones."""
        self._mirror("set_lora", arrays)

        def put(path, x):
            names = leaf_names(path)
            if "lora" in names and names[-1] in arrays:
                layer = next(n for n in names if isinstance(n, int))
                return jax.device_put(np.asarray(arrays[names[-1]][layer], x.dtype), x.sharding)
            return x

        self.state = jax.tree_util.tree_map_with_path(put, self.state)

    def copy_pages(self, pairs: Sequence[tuple[int, int]], local: bool = False) -> None:
        """Device-side copy-on-write: copy page src -> dst for each pair (in a
        hybrid pool: the global layers' pages, or with `local` the ring
        layers')."""
        if not pairs:
            return
        self._mirror("copy_pages", pairs, local)
        prog = self.programs.get(("copy_local" if local else "copy", COPY_WIDTH))
        for src, dst in copy_chunks(pairs):
            self.cache = prog(self.cache, src, dst)
