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
    draft.mirror(batch, key)       # before the target runs `batch`
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jaxkv.config import CacheConfig, SpeculativeConfig
from jaxkv.model.kv_cache import create_cache
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.runner import COPY_WIDTH, Runner
from jaxkv.worker.step_batch import StepBatch, build_step_batch

log = logging.getLogger("jaxkv")


class DraftProposer:
    def __init__(self, model, cache_config: CacheConfig, buckets: Buckets, attention,
                 num_spec: int):
        self.k = num_spec
        self.buckets = buckets
        cache = create_cache(model.config, cache_config)
        self.runner = Runner(model, cache, buckets, attention, max_decode_steps=num_spec,
                             num_top_logprobs=0)

    @classmethod
    def for_engine(cls, spec: SpeculativeConfig, config, engine, buckets: Buckets,
                   draft_model=None) -> "DraftProposer":
        """The draft of `engine` (its model loaded from `spec.model` unless
        given), refused with a ValueError naming the problem."""
        if config.tensor_parallel_size > 1 or (config.num_processes or 1) > 1:
            raise ValueError("speculative_config: method 'draft_model' runs on one device "
                             f"(tensor_parallel_size 1, one process), got tensor_parallel_size "
                             f"{config.tensor_parallel_size}; use method 'ngram'")
        if draft_model is None:
            from checkpoints.loader import load_model

            draft_model, _ = load_model(spec.model, dtype=config.dtype, quantize=config.quantize)
        v, tv = draft_model.config.vocab_size, engine.model_config.vocab_size
        if v != tv:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {v} tokens, "
                             f"the target's {tv}; a draft must share the target's vocabulary")
        attention = dataclasses.replace(engine.attention, mesh=None)  # the target's window
        draft = cls(draft_model, engine.cache_config, buckets, attention,
                    spec.num_speculative_tokens)
        log.info("jaxkv: draft model %s (%d layers), %d proposals per step",
                 spec.model or "given", draft_model.config.num_layers, draft.k)
        return draft

    def program_keys(self) -> list:
        """Its programs: a mirror per step shape, the proposal loops, the page copy."""
        steps = self.buckets.programs()
        return ([("forward", k) for k in steps] + [k for k in steps if k.loops]
                + [("copy", COPY_WIDTH)])

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
        plan = [dataclasses.replace(sc, num_tokens=1, num_spec=0, spec_tokens=[])
                for sc in scheduled]
        batch, key = build_step_batch(plan, self.k, self.runner.page_size, self.buckets)
        S = key.seqs
        batch = dataclasses.replace(batch, sampling=dataclasses.replace(
            batch.sampling, temperature=np.zeros(S, np.float32),
            num_logprobs=np.zeros(S, np.int32)))
        tokens = self.runner.step(batch, key, len(plan)).tokens  # [n, S_live]
        for i, sc in enumerate(scheduled):
            sc.spec_tokens = tokens[:sc.num_spec, i].tolist()
            sc.num_tokens += len(sc.spec_tokens) - sc.num_spec

    # ------------------------------------------------------------ keeping in step

    def mirror(self, batch: StepBatch, key: ProgramKey) -> None:
        """Write the draft's K/V for every row of the target's `batch`."""
        if key.kind != "verify" and batch.logits_indices.shape[0] != key.seqs:
            batch = dataclasses.replace(batch, logits_indices=np.zeros(key.seqs, np.int32))
        self.runner.forward(batch, key)

    def copy_pages(self, pairs) -> None:
        self.runner.copy_pages(pairs)
