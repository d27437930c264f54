"""The Runner's compiled programs (a mixin): their keys, how each is jitted
and lowered (with the sharding plan's shardings when there is one), and
warm-up.

One program per step program key (`Buckets.programs`: mixed, decode,
both, verify), one re-sampler per S for steps with token rules or
penalties (one without penalties, one per penalty history width), one page
copy; "score" (a prompt chunk with logits at every row) and "forward" (K/V
writes only, a draft model's mirror) compile on first use.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxkv.model.kv_cache import copy_pages
from jaxkv.worker.buckets import ProgramKey
from jaxkv.worker.sampler import sample_with_rules
from jaxkv.worker.step import forward_step, score_step, step
from jaxkv.worker.step_batch import PenaltyBatch, empty, empty_rules
from jaxkv.worker.verify import verify_step

# Copy-on-write pairs per page-copy call (padded with trash-to-trash pairs).
COPY_WIDTH = 64


class Programs:
    """Over the Runner's graphdef, state, cache, rng, last, buckets,
    attention, `_sh` (shardings or None) and `_programs` (key -> compiled)."""

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
