"""EAGLE-3 speculation in the engine: a draft head (`jaxkv.model.eagle`)
reads the target's own hidden states and proposes k tokens a step.

The target's step programs also return the features the head reads
(`Llama.aux_layers`, set by `prepare_target` before the model is split) at
every row, left on the device. After each target step (`follow`, once its
tokens are read) one jitted call runs the head over that step's rows:
row p reads the features at p and the token at p + 1 (the next prompt
token, the next accepted proposal, or the token the step just produced),
writing the head's K/V at p into its own one-layer paged cache, which uses
the target's pages, block tables and slot mappings unchanged (as a draft
model's does: page copies are applied to both). At each sequence's last
accepted row that call also gives the first proposal and the head's
hidden state. When the next step is planned and its pages reserved
(`fill`), a second call runs the head k - 1 more times from there, one row
a sequence, each proposal the next input: proposals cost the head's small
steps only. Rows of rejected proposals hold K/V that the next `follow`
rewrites, as the target's do. Proposals are greedy (a point mass), so the
verify step keeps outputs exactly the target's.

    model.aux_layers = ...; head = prepare_target(model, spec)   before the Runner
    eagle = EagleProposer.for_engine(spec, config, engine, buckets, head)
    eagle.follow(scheduled, pending, res)  after each target step
    eagle.fill(scheduled)                  proposals into each ScheduledSeq
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import SpeculativeConfig
from jaxkv.core.plan_builder import build_plan
from jaxkv.core.scheduling.scheduler_output import ScheduledSeq
from jaxkv.model import eagle as head_ops
from jaxkv.model.kv_cache import copy_pages, create_cache
from jaxkv.worker import eagle_programs as programs
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.programs import COPY_WIDTH, copy_chunks
from jaxkv.worker.step_batch import empty, pack

log = logging.getLogger("jaxkv")


@dataclasses.dataclass
class Head:
    """A loaded head: its config and parameters (jaxkv layout, numpy)."""

    config: head_ops.Eagle3Config
    params: dict


def prepare_target(model, spec: SpeculativeConfig, head: Head | None = None) -> Head:
    """Load the head of `spec.model` (unless given), check it against the
    target, and make the target's step programs return the features it
    reads (before the model is split into a Runner)."""
    if head is None:
        from checkpoints.eagle3 import load_eagle3

        cfg, params = load_eagle3(spec.model, model.config)
        head = Head(cfg, params)
    head.config.check_target(model.config)
    model.aux_layers = tuple(head.config.aux_layers)
    return head


class EagleProposer:
    """The head's device side (parameters, its cache, its programs) and the
    host side that plans its calls. Also the engine's `draft`: it follows
    every step and page copy the target runs, decode loops of up to
    `loop_steps` calls included."""

    follows_loops = True  # the engine may run several decode steps per call

    def __init__(
        self,
        head: Head,
        embed,
        cache_config,
        buckets: Buckets,
        attention,
        num_spec: int,
        feature_dtype,
        placement=None,
        loop_steps: int = 1,
    ):
        self.k = num_spec
        self.loop_steps = loop_steps
        self.cfg = cfg = head.config
        self.buckets = buckets
        self.page_size = cache_config.page_size
        put = (lambda x: jax.device_put(x, placement)) if placement is not None else jnp.asarray
        params = {
            n: put(np.asarray(v, np.int32 if n == "d2t" else feature_dtype))
            for n, v in head.params.items()
        }
        self.params = params
        self.embed = None if "embed" in params else put(np.asarray(embed, feature_dtype))
        cache = create_cache(cfg.model_config(), cache_config)
        self.cache = jax.tree_util.tree_map(put, cache)
        self.attention = attention
        self.feature_dtype = jnp.dtype(feature_dtype)
        self.width = max(k.seqs for k in buckets.programs())
        self._programs: dict[Any, Any] = {}
        # The last follow: its device outputs, and id(seq) -> (seq, length after it, index).
        self._first = None
        self._memo: dict[int, tuple[object, int, int]] = {}

    @classmethod
    def for_engine(
        cls, spec: SpeculativeConfig, config, engine, buckets: Buckets, head: Head, model
    ) -> EagleProposer:
        if (config.num_processes or 1) > 1:
            raise ValueError(
                "speculative_config: method 'eagle3' runs in one process; "
                f"got num_processes {config.num_processes}"
            )
        mesh = engine.sharding.mesh if engine.sharding is not None else None
        placement = None
        if mesh is not None:  # the head replicated on the target's devices
            placement = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        attention = dataclasses.replace(
            engine.attention, mesh=None, local_layers=(), ring_pages=0, score_rows=None
        )
        embed = None if "embed" in head.params else head_ops.target_embed(model)
        dtype = model.final_norm[...].dtype
        out = cls(
            head,
            embed,
            engine.cache_config,
            buckets,
            attention,
            spec.num_speculative_tokens,
            dtype,
            placement,
            config.num_decode_steps,
        )
        log.info(
            "jaxkv: EAGLE-3 head %s (features of layers %s, draft vocabulary %d), "
            "%d proposals per step",
            spec.model or "given",
            list(head.config.aux_layers),
            head.config.draft_vocab_size,
            out.k,
        )
        return out

    # ------------------------------------------------------------ programs

    def program_keys(self) -> list:
        steps = self.buckets.programs()
        seqs = sorted({self.buckets.decode_key(s).seqs for s in self.buckets.decode_seqs})
        loops = [("follow_loop", s) for s in seqs] if self.loop_steps > 1 else []
        return (
            [("follow", k) for k in steps]
            + loops
            + [("propose", s) for s in seqs]
            + [("copy", COPY_WIDTH)]
        )

    def _lower(self, key):
        W, k = self.buckets.pages_per_seq, self.buckets.num_spec
        cfg, att = self.cfg, self.attention
        E3 = 3 * cfg.target_hidden_size
        if key[0] == "follow":
            pk: ProgramKey = key[1]
            all_decode = {"decode": True, "both": None}.get(pk.kind, False)
            T, S = pk.tokens, pk.seqs
            # A loop program's features come call by call: its first call's rows.
            fn = jax.jit(
                functools.partial(
                    programs.follow_loop if pk.loops else programs.follow,
                    cfg=cfg,
                    attention=att,
                    all_decode=all_decode,
                    width=self.width,
                ),
                donate_argnums=(2,),
            )
            feats = jax.ShapeDtypeStruct(
                (self.loop_steps, T, E3) if pk.loops else (T, E3), self.feature_dtype
            )
            rows = (np.zeros(T, np.int32),) if pk.loops else ()
            return fn.trace(
                self.params,
                self.embed,
                self.cache,
                empty(pk, W, k),
                feats,
                *rows,
                np.zeros(T, np.int32),
                np.zeros(S, np.int32),
            ).lower()
        if key[0] == "follow_loop":  # S sequences, up to K rows each
            S, K = key[1], self.loop_steps
            fn = jax.jit(
                functools.partial(
                    programs.follow_loop, cfg=cfg, attention=att, all_decode=False, width=self.width
                ),
                donate_argnums=(2,),
            )
            T0 = self.buckets.decode_key(S).tokens
            return fn.trace(
                self.params,
                self.embed,
                self.cache,
                empty(ProgramKey("mixed", K * S, S), W, k),
                jax.ShapeDtypeStruct((K, T0, E3), self.feature_dtype),
                np.zeros(K * S, np.int32),
                np.zeros(K * S, np.int32),
                np.zeros(S, np.int32),
            ).lower()
        if key[0] == "propose":
            S = key[1]
            fn = jax.jit(
                functools.partial(
                    programs.propose, cfg=cfg, attention=att, k=self.k, page_size=self.page_size
                ),
                donate_argnums=(2,),
            )
            return fn.trace(
                self.params,
                self.embed,
                self.cache,
                empty(self.buckets.decode_key(S), W, k),
                np.zeros(self.width, np.int32),
                jax.ShapeDtypeStruct((self.width, cfg.hidden_size), self.feature_dtype),
                np.zeros(S, np.int32),
            ).lower()
        if key[0] == "copy":
            idx = np.zeros(COPY_WIDTH, np.int32)
            return jax.jit(copy_pages, donate_argnums=(0,)).trace(self.cache, idx, idx).lower()
        raise ValueError(f"eagle3: unknown program {key!r}")

    def _get(self, key):
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = self._lower(key).compile()
        return prog

    @property
    def compiled(self) -> list:
        return list(self._programs)

    def warm_up(self) -> dict:
        t0 = time.perf_counter()
        todo = [k for k in self.program_keys() if k not in self._programs]
        for k in todo:
            self._get(k)
        return dict(programs=len(todo), loaded=0, seconds=time.perf_counter() - t0)

    # ------------------------------------------------------------ keeping in step

    def mirror(self, plan, key) -> None:
        """Nothing before the target's step: the head follows it (`follow`)."""

    def copy_pages(self, pairs) -> None:
        if not pairs:
            return
        prog = self._get(("copy", COPY_WIDTH))
        for src, dst in copy_chunks(pairs):
            self.cache = prog(self.cache, src, dst)

    def follow(self, scheduled, pending, res) -> None:
        """Run the head over a target step's rows (`pending.batch`, its
        features `pending.out.features`), now that its tokens `res` are
        read; keep each sampled sequence's first proposal for `fill`."""
        batch, key = pending.batch, pending.key
        feats = pending.out.features
        if feats.ndim == 3 and len(res.tokens) > 1:  # a decode loop of several calls
            self._follow_loop(scheduled, key, feats, res)
            return
        T = batch.token_ids.shape[0]
        toks = np.asarray(batch.token_ids)
        next_ids = np.zeros(T, np.int32)
        next_ids[: T - 1] = toks[1:]
        rows = np.zeros(key.seqs, np.int32)
        memo = {}
        row = 0
        for s, sc in enumerate(scheduled):
            n, k = sc.num_rows, len(sc.spec_tokens)
            seq = sc.seq
            known_end = sc.start + n - k  # positions past the chunk's known tokens
            if known_end < seq.num_tokens:  # a prompt chunk short of the end: no sample
                next_ids[row + n - 1] = seq.all_token_ids[known_end]
                rows[s] = row + n - 1
            else:
                c = int(res.counts[s]) if res.counts is not None else 1
                c = max(1, min(c, len(res.tokens)))
                q = row + (c - 1 if k else n - 1)
                next_ids[q] = int(res.tokens[c - 1, s])
                rows[s] = q
                memo[id(seq)] = (seq, seq.num_tokens + c, s)
            row += n
        prog = self._get(("follow", key))
        first_call = (np.arange(T, dtype=np.int32),) if feats.ndim == 3 else ()
        self.cache, first, hidden = prog(
            self.params, self.embed, self.cache, batch, feats, *first_call, next_ids, rows
        )
        self._first = (first, hidden)
        self._memo = memo

    def _follow_loop(self, scheduled, key, feats, res) -> None:
        """`follow` for a decode loop of n > 1 calls: sequence s's row i (at
        position start + i) read the features of call i and its token. A
        sequence that stopped inside the loop (its max_tokens) holds pages
        for its own rows only: its rows end there."""
        from jaxkv.worker.scoring import plan_for

        n, S, W = len(res.tokens), len(scheduled), self.buckets.pages_per_seq
        T0 = feats.shape[1]
        pages = [np.asarray(sc.seq.progress.pages[:W], np.int32) for sc in scheduled]
        m = [
            max(1, min(n, int(np.count_nonzero(p)) * self.page_size - sc.start))
            for p, sc in zip(pages, scheduled)
        ]  # page 0: none held
        plan = plan_for(
            [
                (res.tokens[: m[s], s], sc.start, np.pad(pages[s], (0, W - len(pages[s]))))
                for s, sc in enumerate(scheduled)
            ]
        )
        hk = ProgramKey("mixed", self.loop_steps * key.seqs, key.seqs)
        batch = pack(plan, hk, self.page_size, W)
        src = np.zeros(hk.tokens, np.int32)
        next_ids = np.zeros(hk.tokens, np.int32)
        rows = np.zeros(key.seqs, np.int32)
        row = 0
        for s in range(S):
            i = np.arange(m[s])
            src[row : row + m[s]] = i * T0 + s
            next_ids[row : row + m[s]] = res.tokens[: m[s], s]
            row += m[s]
            rows[s] = row - 1
        prog = self._get(("follow_loop", key.seqs))
        self.cache, first, hidden = prog(
            self.params, self.embed, self.cache, batch, feats, src, next_ids, rows
        )
        self._first = (first, hidden)
        self._memo = {
            id(sc.seq): (sc.seq, sc.seq.num_tokens + n, s) for s, sc in enumerate(scheduled)
        }

    # ------------------------------------------------------------ proposing

    def max_proposals(self, seq, cap: int) -> int:
        hit = self._memo.get(id(seq))
        return cap if hit is not None and hit[0] is seq and hit[1] == seq.num_tokens else 0

    def fill(self, scheduled) -> None:
        """Proposals (at most each sequence's num_spec) into each drafting
        ScheduledSeq, from the head's k steps after its newest token."""
        if not scheduled:
            return
        index = np.full(len(scheduled), -1, np.int32)
        for i, sc in enumerate(scheduled):
            hit = self._memo.get(id(sc.seq))
            if hit is not None and hit[0] is sc.seq and hit[1] == sc.seq.num_tokens:
                index[i] = hit[2]
        plan, _ = build_plan(
            [ScheduledSeq(sc.seq, sc.start, 1) for sc in scheduled],
            1,
            pages_per_seq=self.buckets.pages_per_seq,
            vocab_size=self.cfg.vocab_size,
        )
        key = self.buckets.decode_key(plan.num_seqs)
        batch = pack(plan, key, self.page_size, self.buckets.pages_per_seq, self.buckets.num_spec)
        idx = np.full(key.seqs, -1, np.int32)
        idx[: len(index)] = index
        first, hidden = self._first
        self.cache, tokens = self._get(("propose", key.seqs))(
            self.params, self.embed, self.cache, batch, first, hidden, idx
        )
        tokens = np.asarray(tokens)
        for i, sc in enumerate(scheduled):
            sc.spec_tokens = tokens[: sc.num_spec, i].tolist() if index[i] >= 0 else []
            sc.num_rows += len(sc.spec_tokens) - sc.num_spec
