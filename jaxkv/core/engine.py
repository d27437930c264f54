"""LLMEngine: requests in, streamed tokens out, many requests per step.

    engine = LLMEngine.from_pretrained("smollm2-135m-instruct")
    rid = engine.add_request("What is a KV cache?", SamplingParams(max_tokens=64))
    while engine.has_unfinished_requests():
        for out in engine.step():
            print(out.outputs[0].delta_text, end="")

Every request submitted ends with a finish reason: "stop" (end token, stop
token or stop string), "length" (max_tokens or the model's context),
"abort", or "error" (refused: the output's `error` names the bad field).
A refused request never disturbs the others.

One step path: the scheduler says what runs (and how many decode steps),
`jaxkv.worker.execute` packs and runs it, the output processor turns
tokens into outputs. With overlapped scheduling (`async_scheduling`) a
step is dispatched and left in flight; the next `step()` plans and
dispatches the one after it, then reads the first one's tokens, so the
host's work runs while the device computes. Outputs then arrive one
`step()` later, and are the same tokens: a sequence that finished in the
step read is dropped from the one in flight, its extra token discarded.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Iterable

import numpy as np

from jaxkv.config import CacheConfig, EngineConfig, ModelConfig
from jaxkv.core.block_manager import BlockManager
from jaxkv.core.output_processor import OutputProcessor
from jaxkv.core.outputs import RequestOutput
from jaxkv.core.intake import RequestIntake
from jaxkv.core.overlap import InFlight, Overlap, overlap_default
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.core.scheduler import Scheduler, SchedulerOutput, step_kind
from jaxkv.core.sequence import Sequence
from jaxkv.core.spec_decode import SpecGate, SpecStats, make_proposer
from jaxkv.core.structured import Grammars
from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import create_cache
from jaxkv.model.memory import max_model_len, plan_num_pages
from jaxkv.sharding import shard_nbytes
from jaxkv.worker.distributed import init_distributed, scale_out
from jaxkv.worker.runner import Runner
from jaxkv.worker.execute import execute, execute_scored
from jaxkv.worker.buckets import Buckets

log = logging.getLogger("jaxkv")


class LLMEngine(RequestIntake, Overlap):
    """The engine: `add_request` / `check_request` / `abort` (the request
    side, `jaxkv.core.intake`), `step` (overlapped: `jaxkv.core.overlap`),
    `run_to_completion`."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None,
                 draft_model=None):
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        model, self.sharding, channel = scale_out(model, config)
        self.model_config: ModelConfig = model.config  # KV heads as stored (replicated)
        kv_dtype = config.kv_dtype or config.dtype
        num_pages = plan_num_pages(config, self.model_config, kv_dtype,
                                   config.tensor_parallel_size)
        self.cache_config = CacheConfig(num_pages=num_pages, page_size=config.page_size,
                                        kv_dtype=kv_dtype)
        pool_tokens = (num_pages - 1) * config.page_size
        self.attention = AttentionSpec.for_engine(self.model_config, config,
                                                  self.sharding.mesh if self.sharding else None)
        self.max_model_len = max_model_len(config, self.model_config, self.attention,
                                           pool_tokens)
        self.bm = BlockManager(num_pages, config.page_size,
                               enable_prefix_caching=config.enable_prefix_caching)
        buckets = Buckets.make(config.max_num_seqs, config.max_num_batched_tokens,
                               -(-self.max_model_len // config.page_size), self.max_model_len,
                               num_spec=config.num_speculative_tokens)
        # A draft model keeps its own cache in step, so it sees every step.
        self.proposer, self.draft = make_proposer(config, self, buckets, draft_model)
        self.spec_stats = SpecStats()
        self.scheduler = Scheduler(self.bm, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   max_num_steps=1 if self.draft else config.num_decode_steps,
                                   proposer=self.proposer, num_spec=buckets.num_spec,
                                   gate=SpecGate() if self.proposer is not None
                                   and config.speculative.adaptive else None)
        cache = create_cache(self.model_config, self.cache_config,
                             self.sharding.cache_sharding() if self.sharding else None)
        self.runner = Runner(model, cache, buckets, self.attention,
                             max_decode_steps=config.num_decode_steps,
                             num_top_logprobs=SamplingParams.MAX_LOGPROBS, seed=config.seed,
                             plan=self.sharding, channel=channel)
        self.outputs = OutputProcessor(tokenizer)
        self.grammars = Grammars(tokenizer, model.config.vocab_size, model.config.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._errors: list[Sequence] = []
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self.async_scheduling = overlap_default(config) and self.proposer is None
        self._inflight: InFlight | None = None
        # decode_steps: model calls; partial_prefills: chunks short of the prompt's end;
        # overlapped_steps: steps dispatched while the one before was in flight.
        self.stats = dict(steps=0, decode_steps=0, prompt_tokens_computed=0, generated_tokens=0,
                          partial_prefills=0, step_seconds=0.0, overlapped_steps=0)
        log.info("jaxkv: KV cache %d pages x %d tokens = %d tokens (%s, %.1f MiB per device "
                 "on %d); max_model_len %d; up to %d sequences at full length", num_pages,
                 config.page_size, pool_tokens, kv_dtype, shard_nbytes(self.runner.cache)
                 / 2**20, config.tensor_parallel_size, self.max_model_len,
                 max(1, pool_tokens // self.max_model_len))
        self.warmup_report = None
        if config.warmup:
            if self.draft is not None:
                self.draft.warm_up()
            self.warmup_report = self.runner.warm_up()
            log.info("jaxkv: warm-up compiled %(programs)d programs in %(seconds).1f s",
                     self.warmup_report)

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m-instruct", **config: Any) -> "LLMEngine":
        """Load a model by name or path (HF folder, GGUF file, jaxkv checkpoint)."""
        from checkpoints.loader import load_model

        cfg = EngineConfig(**config)
        init_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
        module, tokenizer = load_model(model, dtype=cfg.dtype, quantize=cfg.quantize)
        return cls(module, tokenizer, cfg)

    def follow(self) -> bool:
        """Processes 1..n-1 of a job: run the steps process 0 sends until it
        stops (its `shutdown` or exit), then True; False at once on process 0."""
        ch = self.runner.channel
        if ch is None or ch.leader:
            return False
        self.runner.follow()
        return True

    def shutdown(self) -> None:
        """Process 0 of several: release the followers (also done at exit)."""
        self.runner.stop_followers()

    # ------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that produced
        tokens or finished. With overlapped scheduling the step run is left
        in flight and the previous one's outputs are returned."""
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.stats["step_seconds"] += time.perf_counter() - t0

    def _step(self) -> list[RequestOutput]:
        outputs = [self._output(s) for s in self._errors]
        self._errors.clear()
        prev, self._inflight = self._inflight, None
        if prev is not None:
            if self._overlaps():
                sched = self.scheduler.schedule(lookahead=True)
                if sched.needs_preemption:  # its reservations stay for the plan below
                    self.runner.copy_pages(sched.copies)
                elif sched.scheduled:
                    self._inflight = self._dispatch(sched, prev)
                    self.stats["overlapped_steps"] += 1
            outputs += self._resolve(prev)
            if self._inflight is not None:
                return outputs
        p0, programs = self.scheduler.propose_seconds, self._num_programs()
        sched = self.scheduler.schedule()
        self._propose_step_seconds = self.scheduler.propose_seconds - p0
        if self._num_programs() != programs:  # the draft compiled: not a cost to learn from
            self._propose_step_seconds = float("nan")
        if not sched.scheduled:
            if self.scheduler.has_unfinished() and not outputs:
                raise RuntimeError("scheduler made no progress: the page pool is too small "
                                   "for any waiting request")
            return outputs
        if self._overlaps():
            self._inflight = self._dispatch(sched, None)
        else:
            outputs += self._run(sched)
        return outputs

    def _num_programs(self) -> int:
        """Programs compiled so far (the draft's too): a step that compiled
        one says nothing about what a step costs."""
        return len(self.runner.compiled) + (len(self.draft.runner.compiled) if self.draft else 0)

    def speculative_metrics(self) -> dict:
        """Speculative decoding so far ({} when off): verify steps, drafts,
        proposed and accepted tokens, acceptance rate, mean accepted length,
        and the seconds spent proposing with their share of step time."""
        if self.proposer is None:
            return {}
        d = self.spec_stats.as_dict()
        d["propose_seconds"] = secs = self.scheduler.propose_seconds
        d["propose_share"] = secs / self.stats["step_seconds"] if self.stats["step_seconds"] else 0.0
        return d

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        self.runner.copy_pages(sched.copies)
        mirror = self.draft.mirror if self.draft is not None else None
        if mirror is not None:
            self.draft.copy_pages(sched.copies)
        V = self.model_config.vocab_size
        scored = [sc for sc in sched.scheduled if sc.seq.scores_prompt(sc.start)]
        plain = [sc for sc in sched.scheduled if id(sc) not in {id(x) for x in scored}]
        touched: dict[int, Sequence] = {}
        if plain:
            t0, programs = time.perf_counter(), self._num_programs()
            res, stuck = execute(self.runner, plain, sched.num_steps, V, mirror)
            seconds = time.perf_counter() - t0 + self._propose_step_seconds
            counted = self._accept(plain, res, stuck, touched)
            gate = self.scheduler.gate
            if gate is not None:
                if self._num_programs() != programs:  # a compile ran inside: no cost figure
                    seconds = float("nan")
                gate.observe(step_kind(plain), counted is not None, len(plain),
                                            seconds, len(res.tokens) if counted is None else 1,
                                            *(counted or ()))
        for sc in scored:  # prompt chunks with prompt log-probabilities
            tgt, top_ids, top_lps, res, stuck = execute_scored(self.runner, sc, V, mirror)
            self.outputs.prompt_logprobs(sc.seq, sc.start, sc.num_tokens, tgt, top_ids, top_lps)
            self._accept([sc], res, stuck, touched)
        self.stats["steps"] += 1
        return [self._output(p) for p in touched.values()]

    def _accept(self, scheduled, res, stuck: list[int], touched: dict):
        """Hand each sequence's sampled tokens to the output processor;
        returns (proposed, accepted) of a verify step, else None."""
        counted = self.spec_stats.record(scheduled, res)
        if counted is not None:
            self.stats["decode_steps"] += 1
            if self.spec_stats.steps % 100 == 0:
                log.info("jaxkv: speculative decoding: %s", self.speculative_metrics())
        else:
            self.stats["decode_steps"] += len(res.tokens)
        for i, sc in enumerate(scheduled):
            s = sc.seq
            if s.finished:  # finished (or aborted) while this step was in flight
                continue
            if not sc.completes:  # a prefill chunk short of the prompt's end
                self.stats["prompt_tokens_computed"] += sc.num_tokens
                self.stats["partial_prefills"] += 1
                self._computed(s, sc.start + sc.num_tokens)
                if s.fork_pending and sc.start + sc.num_tokens == s.prefill_target:
                    self._fork(s)
                continue
            if not s.output_token_ids:
                self.stats["prompt_tokens_computed"] += sc.num_tokens
            self._computed(s, sc.known_end)
            if i in stuck:
                s.finish("error", error="structured_outputs: no token can continue the "
                                        "output (the rules allow none)")
            for k in range(0 if i in stuck else int(res.counts[i])):
                if not res.finite[k, i]:
                    s.finish("error", error=f"logits: not finite (NaN or inf) at output token "
                                            f"{len(s.output_token_ids)}: the model's weights or "
                                            "activations overflow")
                    break
                self.outputs.accept(s, int(res.tokens[k, i]), float(res.logprobs[k, i]),
                                    res.top_ids[k, i], res.top_logprobs[k, i])
                self.stats["generated_tokens"] += 1
                if s.finished:
                    break
            if s.finished:
                self.scheduler.remove(s)
            elif res.counts[i] > 1:  # every token but the newest has its K/V written
                self._computed(s, s.num_tokens - 1)
            if not s.finished:  # slots reserved for rejected proposals go back
                self.bm.trim(s.request_id, s.planned_tokens)
            touched[id(s.parent)] = s.parent
        return counted

    def _computed(self, s: Sequence, num_computed: int) -> None:
        """Record K/V written up to num_computed; free pages behind the window."""
        self.bm.mark_computed(s.request_id, s.all_token_ids, num_computed)
        window = self.attention.sliding_window
        if window is not None:  # the next query sits at num_computed
            self.bm.release_range(s.request_id, self.attention.num_sink_tokens,
                                  num_computed - window + 1)

    def _output(self, s: Sequence) -> RequestOutput:
        """The request's output (all its sequences); `s` is its parent."""
        if all(c.finished for c in s.children):  # its final output: the engine forgets it
            self._seqs.pop(s.request_id, None)
        return self.outputs.output(s)

    def run_to_completion(self, request_ids: Iterable[str] | None = None,
                          progress=None) -> dict[str, RequestOutput]:
        """Step until every request (or the given ones) finished; returns the
        final outputs by request id. `progress(n_finished, n_new_tokens)` is
        called after every step when given."""
        wanted = set(request_ids) if request_ids is not None else None
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            outs = self.step()
            new = 0
            for o in outs:
                new += sum(len(c.delta_token_ids) for c in o.outputs)
                if o.finished and (wanted is None or o.request_id in wanted):
                    final[o.request_id] = o
            if progress is not None:
                progress(len(final), new)
            if wanted is not None and wanted <= final.keys():
                break
        if self.proposer is not None:
            log.info("jaxkv: speculative decoding: %s", self.speculative_metrics())
        return final
