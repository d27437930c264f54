"""The compiled programs of one Runner: their keys, how each is jitted and
lowered (with the sharding plan's shardings when there is one), compiled
once, kept on disk (`jaxkv.worker.program_store`) and warmed up.

One program per step program key (`Buckets.programs`: mixed, decode,
both, verify), one re-sampler per S for steps with token rules or
penalties (one without penalties, one per penalty history width), one page
copy; "score" (a prompt chunk with logits at every row) and "forward" (K/V
writes only, a draft model's mirror) compile on first use.

    programs = Programs(graphdef, examples, buckets, attention, ...)
    programs.get(key)        compiled (from memory, the store, or compiled now)
    programs.lower(key)      jax.stages.Lowered (any platform)
    programs.warm_up()       every program not ready yet, two compiles at a time
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxkv.model.kv_cache import copy_pages, gather_pages, put_pages
from jaxkv.model.kv_scores import compact_pages, gather_scores
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.sampler import sample_with_rules
from jaxkv.worker.step import forward_step, score_step, step
from jaxkv.worker.step_batch import PenaltyBatch, empty, empty_rules
from jaxkv.worker.verify import verify_step

log = logging.getLogger("jaxkv")

_HITS: set[int] = set()  # threads whose compile JAX's persistent cache served
# digests of the modules it served: JAX's in-memory cache hands the same
# executable to a later compile of that module in this process, with no
# cache event
_SERVED: set[bytes] = set()


def _on_event(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _HITS.add(threading.get_ident())


jax.monitoring.register_event_listener(_on_event)

# Copy-on-write pairs per page-copy call (padded with trash-to-trash pairs).
COPY_WIDTH = 64


def copy_chunks(pairs):
    """Copy-on-write (src, dst) pairs as the page-copy program's arguments:
    (src [COPY_WIDTH], dst [COPY_WIDTH]) per chunk, padded with trash-to-trash pairs."""
    for i in range(0, len(pairs), COPY_WIDTH):
        chunk = list(pairs[i : i + COPY_WIDTH])
        src = np.zeros(COPY_WIDTH, np.int32)
        dst = np.zeros(COPY_WIDTH, np.int32)
        src[: len(chunk)] = [q[0] for q in chunk]
        dst[: len(chunk)] = [q[1] for q in chunk]
        yield src, dst


# Pages per host-tier transfer (`jaxkv.core.kv.tiers`), padded with the trash page.
TRANSFER_WIDTH = 32


class Programs:
    """`examples` holds the runner's arguments as jax.ShapeDtypeStructs
    (with their shardings under a plan): state, cache, rng, last.
    `shardings` is None on one device, else {"state", "cache", "rep"}.
    `store` (a `ProgramStore` or None) keeps compiled programs across
    runs."""

    def __init__(
        self,
        graphdef,
        examples: dict,
        buckets: Buckets,
        attention,
        *,
        vocab_size: int,
        max_decode_steps: int,
        num_top_logprobs: int,
        shardings: dict | None = None,
        store=None,
        offload: bool = False,
    ):
        self.graphdef = graphdef
        self.examples = examples
        self.buckets = buckets
        self.attention = attention
        self.vocab_size = vocab_size
        self.max_decode_steps = max_decode_steps
        self.num_top_logprobs = num_top_logprobs
        self.shardings = shardings
        self.store = store
        self.offload = offload  # the page transfers of a host tier are warmed up too
        self._compiled: dict[Any, Any] = {}

    def keys(self) -> list:
        """Every program warm-up compiles: step programs, penalty samplers
        (per sequence bucket and history width), the page copy."""
        seqs = sorted({k.seqs for k in self.buckets.programs()})
        return (
            self.buckets.programs()
            + [("rules", s, n) for s in seqs for n in (0, *self.buckets.history)]
            + [("copy", COPY_WIDTH)]
            + ([("copy_local", COPY_WIDTH)] if self.attention.local_layers else [])
            + ([("page_out", TRANSFER_WIDTH), ("page_in", TRANSFER_WIDTH)] if self.offload else [])
        )

    @property
    def compiled(self) -> list:
        """Keys of the programs ready so far (compiled or loaded)."""
        return list(self._compiled)

    def _jit(self, fn, args: str, out: str, donate: tuple = ()):
        """jax.jit of `fn` whose arguments / outputs are, by letter, the
        parameters (s), the cache (c) or anything else (r: replicated)
        under a sharding plan; plain jax.jit without one."""
        if self.shardings is None:
            return jax.jit(fn, donate_argnums=donate)
        pick = {
            "s": self.shardings["state"],
            "c": self.shardings["cache"],
            "r": self.shardings["rep"],
        }
        outs = tuple(pick[c] for c in out)
        return jax.jit(
            fn,
            donate_argnums=donate,
            in_shardings=tuple(pick[c] for c in args),
            out_shardings=outs[0] if len(outs) == 1 else outs,
        )

    def lower(self, key, lowering_platforms=None):
        """The jitted function of `key` lowered with placeholder inputs
        (jax.stages.Lowered; `.compile()` it), for `lowering_platforms`
        (e.g. ("cuda",)) when given instead of this machine's."""
        g, ex = self.graphdef, self.examples
        state, cache, rng, last = ex["state"], ex["cache"], ex["rng"], ex["last"]
        kw = {} if lowering_platforms is None else dict(lowering_platforms=lowering_platforms)
        W, k = self.buckets.pages_per_seq, self.buckets.num_spec
        if key[0] == "score":  # (score, T, S): a prompt chunk with logits at every row
            _, T, S = key
            fn = self._jit(
                functools.partial(
                    score_step, g, num_top_logprobs=self.num_top_logprobs, attention=self.attention
                ),
                "scrrr",
                "rc",
                (1,),
            )
            batch = dataclasses.replace(
                empty(ProgramKey("mixed", T, S), W), logits_indices=np.zeros(T, np.int32)
            )
            return fn.trace(state, cache, batch, rng, np.zeros(T, np.int32)).lower(**kw)
        if key[0] == "forward":  # ("forward", ProgramKey): K/V writes only
            fn = self._jit(
                functools.partial(forward_step, g, kind=key[1].kind, attention=self.attention),
                "scr",
                "c",
                (1,),
            )
            return fn.trace(state, cache, empty(key[1], W, k)).lower(**kw)
        if isinstance(key, ProgramKey):
            common = dict(num_top_logprobs=self.num_top_logprobs, attention=self.attention)
            if key.kind == "verify":
                fn = functools.partial(verify_step, g, num_spec=k, **common)
            else:
                fn = functools.partial(
                    step,
                    g,
                    kind=key.kind,
                    **common,
                    max_steps=self.max_decode_steps if key.loops else 1,
                )
            fn = self._jit(fn, "scrrr", "rcr", (1, 4))
            return fn.trace(state, cache, empty(key, W, k), rng, last).lower(**kw)
        if key[0] == "rules":
            _, S, N = key
            fn = self._jit(
                functools.partial(sample_with_rules, num_top_logprobs=self.num_top_logprobs),
                "rrrrrr",
                "r",
            )
            b = empty(ProgramKey("mixed", S, S), W)
            logits = jax.ShapeDtypeStruct((S, self.vocab_size), np.float32)
            pen = PenaltyBatch(np.zeros((S, N), np.int32), np.zeros((S, N), bool)) if N else None
            return fn.trace(
                logits, b.sampling, pen, empty_rules(S, self.vocab_size), rng, b.num_output
            ).lower(**kw)
        if key[0] in ("copy", "copy_local"):  # a hybrid pool: the global or the ring layers
            idx = np.zeros(COPY_WIDTH, np.int32)
            local = self.attention.local_layers
            layers = (
                (
                    local
                    if key[0] == "copy_local"
                    else tuple(i for i in range(len(cache.k)) if i not in local)
                )
                if local
                else None
            )
            fn = functools.partial(copy_pages, layers=layers)
            return self._jit(fn, "crr", "c", (0,)).trace(cache, idx, idx).lower(**kw)
        if key[0] == "page_out":  # pages -> their contents, for the host tier
            idx = np.zeros(key[1], np.int32)
            return self._jit(gather_pages, "cr", "r").trace(cache, idx).lower(**kw)
        if key[0] == "page_in":  # contents -> pages
            idx = np.zeros(key[1], np.int32)
            data = jax.eval_shape(gather_pages, cache, idx)
            return self._jit(put_pages, "crr", "c", (0,)).trace(cache, idx, data).lower(**kw)
        if key[0] == "scores":  # importance eviction: one row's accumulated attention
            return (
                self._jit(gather_scores, "cr", "r")
                .trace(cache, np.zeros(key[1], np.int32))
                .lower(**kw)
            )
        if key[0] == "compact":  # ... and its kept tokens moved to its first slots
            _, W, B = key
            src = np.zeros((len(cache.k), cache.k[0].shape[0], B), np.int32)
            return (
                self._jit(compact_pages, "crrr", "c", (0,))
                .trace(cache, np.zeros(W, np.int32), src, np.int32(B))
                .lower(**kw)
            )
        raise ValueError(f"program: unknown key {key!r}")

    def get(self, key):
        """The compiled program of `key`: kept, else loaded from the store,
        else lowered and compiled now (and stored)."""
        prog = self._compiled.get(key)
        if prog is None:
            prog = self._load(key)
            if prog is None:
                prog, fresh = self._compile(self.lower(key))
                if fresh:
                    self._save(key, prog)
            self._compiled[key] = prog
        return prog

    @staticmethod
    def _compile(lowered) -> tuple[Any, bool]:
        """(the compiled program, whether XLA compiled it now). One that
        JAX's persistent compilation cache gave back is not stored: it does
        not serialize whole again (XLA's CPU runtime then misses its fused
        kernels), nor is one JAX's in-memory cache hands back a second time
        in this process (no cache event then: `_SERVED` remembers the
        module)."""
        me = threading.get_ident()
        _HITS.discard(me)
        prog = lowered.compile()
        served = me in _HITS
        if served or _SERVED:  # the module's text only once the cache served one
            module = hashlib.sha256(lowered.as_text().encode()).digest()
            if served:
                _SERVED.add(module)
            served = module in _SERVED
        fresh = not served
        _HITS.discard(me)
        return prog, fresh

    def _load(self, key):
        return self.store.load(key) if self.store is not None else None

    def _save(self, key, prog) -> None:
        if self.store is not None:
            self.store.save(key, prog)

    def warm_up(
        self,
        progress: bool | Callable[[int, int], None] = True,
        keys: Sequence | None = None,
        workers: int = 2,
    ) -> dict[str, Any]:
        """Make every program (or `keys`) ready: load what the store has,
        compile the rest; returns {"programs": number made ready,
        "loaded": of them from the store, "seconds": wall time}.
        `progress`: a tqdm bar, or a callback (done, total)."""
        todo = [k for k in (self.keys() if keys is None else keys) if k not in self._compiled]
        t0 = time.perf_counter()
        loaded = 0
        for k in list(todo):
            prog = self._load(k)
            if prog is not None:
                self._compiled[k] = prog
                todo.remove(k)
                loaded += 1
        bar = None
        if progress is True and todo:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(todo), desc="jaxkv warm-up", unit="program", dynamic_ncols=True)
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            # Tracing holds the GIL, XLA's compile does not: lower here,
            # compile in the pool.
            futures = {
                pool.submit(self._compile, low): k for k, low in ((k, self.lower(k)) for k in todo)
            }
            for n, fut in enumerate(concurrent.futures.as_completed(futures), 1):
                k = futures[fut]
                self._compiled[k], fresh = fut.result()
                if fresh:
                    self._save(k, self._compiled[k])
                if bar is not None:
                    bar.update(1)
                elif callable(progress):
                    progress(n, len(todo))
        if bar is not None:
            bar.close()
        return dict(programs=len(todo) + loaded, loaded=loaded, seconds=time.perf_counter() - t0)
