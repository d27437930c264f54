"""A draft model for speculative decoding: a smaller model of the same
vocabulary proposes k tokens per decoding sequence, greedily, which the
target verifies in one step (`jaxkv.worker.verify`).

The draft has its own paged KV cache of the target's shape of pool (same
pages, same page size), so the target's block tables and slot mappings
address it unchanged: every batch the target runs, the draft runs first
for its K/V writes alone (`mirror`, a "forward" program per step shape),
and page copies are applied to both. Its cache thus holds K/V wherever the
target's does, across chunked prefill, prefix-cache hits, preemption and
forks. To propose, the draft runs its multi-step decode program (a
`while_loop` of k model calls in one jitted call, `jaxkv.worker.step`)
from each sequence's last token with temperature 0; those writes land in
slots the target reserved for the same positions and are rewritten by the
mirror of the verify step.

    draft = DraftProposer.for_engine(spec, engine_config, engine, buckets)
    draft.fill(scheduled)          # proposals into each ScheduledSeq
    draft.mirror(plan, key)        # before the target runs `plan` with program `key`

The draft's device side is a worker `Runner` of its own; this is the
host side that plans its steps.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jaxkv.config import CacheConfig, SpeculativeConfig
from jaxkv.core.plan_builder import build_plan
from jaxkv.core.scheduling.scheduler_output import ScheduledSeq
from jaxkv.core.spec.decode import NgramProposer
from jaxkv.model.kv_cache import create_cache
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.plan import StepPlan
from jaxkv.worker.programs import COPY_WIDTH
from jaxkv.worker.runner import Runner

log = logging.getLogger("jaxkv")


class DraftProposer:
    follows_loops = False  # it mirrors one row per sequence before each step

    def __init__(
        self,
        model,
        cache_config: CacheConfig,
        buckets: Buckets,
        attention,
        num_spec: int,
        store=None,
    ):
        self.k = num_spec
        self.buckets = buckets
        self.vocab_size = model.config.vocab_size
        cache = create_cache(model.config, cache_config)
        self.runner = Runner(
            model,
            cache,
            buckets,
            attention,
            max_decode_steps=num_spec,
            num_top_logprobs=0,
            store=store,
        )

    @classmethod
    def for_engine(
        cls, spec: SpeculativeConfig, config, engine, buckets: Buckets, draft_model=None, store=None
    ) -> DraftProposer:
        """The draft of `engine` (its model loaded from `spec.model` unless
        given), refused with a ValueError naming the problem."""
        if config.tensor_parallel_size > 1 or (config.num_processes or 1) > 1:
            raise ValueError(
                "speculative_config: method 'draft_model' runs on one device "
                f"(tensor_parallel_size 1, one process), got tensor_parallel_size "
                f"{config.tensor_parallel_size}; use method 'ngram'"
            )
        if draft_model is None:
            from checkpoints.loader import load_model

            draft_model, _ = load_model(spec.model, dtype=config.dtype, quantize=config.quantize)
        v, tv = draft_model.config.vocab_size, engine.model_config.vocab_size
        if v != tv:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary has {v} tokens, "
                f"the target's {tv}; a draft must share the target's vocabulary"
            )
        attention = dataclasses.replace(engine.attention, mesh=None)  # the target's window
        draft = cls(
            draft_model, engine.cache_config, buckets, attention, spec.num_speculative_tokens, store
        )
        log.info(
            "jaxkv: draft model %s (%d layers), %d proposals per step",
            spec.model or "given",
            draft_model.config.num_layers,
            draft.k,
        )
        return draft

    def program_keys(self) -> list:
        """Its programs: a mirror per step shape, the proposal loops, the page copy."""
        steps = self.buckets.programs()
        return (
            [("forward", k) for k in steps] + [k for k in steps if k.loops] + [("copy", COPY_WIDTH)]
        )

    @property
    def compiled(self) -> list:
        return self.runner.compiled

    def warm_up(self) -> dict:
        return self.runner.warm_up(progress=False, keys=self.program_keys())

    # ------------------------------------------------------------ proposing

    def max_proposals(self, seq, cap: int) -> int:
        return cap  # the draft always proposes; the verify step judges

    def fill(self, scheduled) -> None:
        """Run the draft k steps ahead from each sequence's last token
        (greedy) and set its proposals (at most its num_spec)."""
        if not scheduled:
            return
        plan, _ = build_plan(
            [ScheduledSeq(sc.seq, sc.start, 1) for sc in scheduled],
            self.k,
            pages_per_seq=self.buckets.pages_per_seq,
            vocab_size=self.vocab_size,
        )
        S = plan.num_seqs
        plan = dataclasses.replace(
            plan,
            penalties=None,
            rules=None,
            sampling=dataclasses.replace(
                plan.sampling,
                temperature=np.zeros(S, np.float32),
                num_logprobs=np.zeros(S, np.int32),
            ),
        )
        tokens = self.runner.step(plan).tokens  # [n, S]
        for i, sc in enumerate(scheduled):
            sc.spec_tokens = tokens[: sc.num_spec, i].tolist()
            sc.num_rows += len(sc.spec_tokens) - sc.num_spec

    # ------------------------------------------------------------ keeping in step

    def mirror(self, plan: StepPlan, key: ProgramKey) -> None:
        """Write the draft's K/V for every row of the target's `plan`, run
        by the target's program `key`."""
        self.runner.forward(plan, key)

    def copy_pages(self, pairs) -> None:
        self.runner.copy_pages(pairs)

    def follow(self, scheduled, pending, res) -> None:
        """Nothing after the target's step: the mirror ran before it."""


def eagle_head(model, spec, given=None):
    """With method "eagle3": the head (loaded, or `given` as a
    `jaxkv.core.spec.eagle.Head`), the target set to return the features it
    reads; else None. Before the target's Runner is made."""
    if spec is None or spec.method != "eagle3":
        return None
    from jaxkv.core.spec.eagle import Head, prepare_target

    return prepare_target(model, spec, given if isinstance(given, Head) else None)


def make_proposer(config, engine, buckets, draft_model=None, store=None, head=None, model=None):
    """(proposer, draft) for an engine: (None, None) when speculation is
    off; a draft model's proposer, or an EAGLE-3 head's (`head`, from
    `jaxkv.core.spec.eagle.prepare_target`, and the target `model`), is also the
    draft (it follows every step into its own cache)."""
    spec = config.speculative
    if spec is None:
        return None, None
    if spec.method == "ngram":
        return NgramProposer(spec), None
    if spec.method == "eagle3":
        from jaxkv.core.spec.eagle import EagleProposer

        eagle = EagleProposer.for_engine(spec, config, engine, buckets, head, model)
        return eagle, eagle
    draft = DraftProposer.for_engine(spec, config, engine, buckets, draft_model, store)
    return draft, draft
