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

The engine wires collaborators, each given what it needs by its
constructor: `RequestIntake` (requests in, aborts), the `Scheduler` (what
runs next; each running sequence's progress), `SpecControl`
(speculation), the `Executor` (a step as one plan for the worker
`Runner`), `Overlap` (the step in flight; overlapped scheduling,
`jaxkv.core.overlap`, gives the same tokens one `step()` later) and the
`OutputProcessor` (tokens to text and outputs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.adapters.lora import LoRAAdapters, attach_lora
from jaxkv.core.executor import Executor
from jaxkv.core.intake import RequestIntake
from jaxkv.core.kv.evict import make_evictor
from jaxkv.core.kv.tiers import make_tier, persist, tier_metrics
from jaxkv.core.output_processor import OutputProcessor
from jaxkv.core.outputs import RequestOutput
from jaxkv.core.overlap import Overlap, overlap_default
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.core.scheduling.block_manager import BlockManager
from jaxkv.core.scheduling.scheduler import Scheduler
from jaxkv.core.scheduling.scheduler_output import SchedulerOutput
from jaxkv.core.scheduling.seats import Seats
from jaxkv.core.sequence import Sequence
from jaxkv.core.spec.decode import SpecControl
from jaxkv.core.spec.draft_model import eagle_head, make_proposer
from jaxkv.core.structured import Grammars
from jaxkv.model.kv_cache import create_cache, preset_fp8_scales
from jaxkv.model.pool_sizing import engine_pool
from jaxkv.sharding import shard_nbytes
from jaxkv.worker.buckets import Buckets
from jaxkv.worker.calibrate import calibrate_kv_scales
from jaxkv.worker.distributed import Follower, Leader, init_distributed, scale_out
from jaxkv.worker.plan import StepResult
from jaxkv.worker.program_store import ProgramStore
from jaxkv.worker.runner import Runner

log = logging.getLogger("jaxkv")


class LLMEngine:
    """The engine: `add_request` / `check_request` / `abort` (the request
    side, `jaxkv.core.intake`), `step`, `run_to_completion`."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, draft_model=None):
        self.config = config = config or EngineConfig()
        self.tokenizer = tokenizer
        model, base = attach_lora(model, config)  # LoRA slots (zeros) before it is placed
        model, self.sharding, channel = scale_out(model, config)
        self.model_config: ModelConfig = model.config  # KV heads as stored (replicated)
        self.cache_config, self.attention, self.max_model_len = engine_pool(
            config, self.model_config, self.sharding.mesh if self.sharding else None
        )
        num_pages, kv_dtype = self.cache_config.num_pages, self.cache_config.kv_dtype
        ring, local = self.attention.ring_pages, self.attention.local_layers
        buckets = Buckets.make(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            -(-self.max_model_len // config.page_size),
            self.max_model_len,
            num_spec=config.num_speculative_tokens,
        )
        self.bm = BlockManager(
            num_pages,
            config.page_size,
            enable_prefix_caching=config.enable_prefix_caching,
            pages_per_seq=buckets.pages_per_seq,
        )
        leader = Leader(channel) if channel is not None and channel.leader else None
        self.follower = Follower(channel) if channel is not None and not channel.leader else None
        # fp8: the checkpoint's KV scales where it carries them, else calibrated below.
        cache, kv_scales = _engine_cache(model, self.cache_config, self.sharding)
        store = ProgramStore.for_engine(config)
        head = eagle_head(model, config.speculative, draft_model)  # its steps return features
        self.runner = Runner(
            model,
            cache,
            buckets,
            self.attention,
            max_decode_steps=config.num_decode_steps,
            num_top_logprobs=SamplingParams.MAX_LOGPROBS,
            seed=config.seed,
            sharding=self.sharding,
            leader=leader,
            store=store,
            offload=config.kv_offload_memory is not None,
        )
        if self.follower is None and kv_scales is None:  # fp8: on a fixed text (mirrored)
            calibrate_kv_scales(self.runner, tokenizer, self.model_config.vocab_size, config, ring)
        self.loras = (
            LoRAAdapters(
                base,
                config.max_loras,
                config.max_lora_rank,
                self.runner.set_lora,
                self.sharding,
                config.max_cpu_loras,
            )
            if config.enable_lora
            else None
        )
        # A draft model keeps its own cache in step, so it sees every step.
        proposer, self.draft = make_proposer(config, self, buckets, draft_model, store, head, model)
        self.evictor = make_evictor(config, self.runner, self.bm)  # snapkv / h2o
        self.tier = self.bm.tier = make_tier(
            config, self.runner, model, kv_dtype, hybrid=bool(ring), draft=self.draft is not None
        )
        spec = config.speculative
        self.spec = (
            SpecControl(proposer, buckets.num_spec, spec.adaptive, self._num_programs)
            if proposer is not None
            else None
        )
        self.scheduler = Scheduler(
            self.bm,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_num_steps=config.num_decode_steps
            if not self.evictor and (self.draft is None or self.draft.follows_loops)
            else 1,
            spec=self.spec,
            window=self.attention.sliding_window,
            num_sink_tokens=self.attention.num_sink_tokens,
            seats=Seats(
                config.max_num_seqs,
                ring,
                config.page_size,
                max(w or 0 for w in self.model_config.windows),
            ),
            loras=self.loras,
        )
        self.executor = Executor(
            self.runner, self.model_config.vocab_size, self.draft, self.tier, self.evictor
        )
        # decode_steps: model calls; partial_prefills: chunks short of the prompt's end;
        # overlapped_steps: steps dispatched while the one before was in flight.
        self.stats = dict(
            steps=0,
            decode_steps=0,
            prompt_tokens_computed=0,
            generated_tokens=0,
            partial_prefills=0,
            step_seconds=0.0,
            overlapped_steps=0,
        )
        self.outputs = OutputProcessor(tokenizer, self.scheduler, self.stats)
        self.grammars = Grammars(tokenizer, model.config.vocab_size, model.config.eos_token_ids)
        self.intake = RequestIntake(
            config,
            self.model_config,
            self.max_model_len,
            tokenizer,
            self.grammars,
            self.scheduler,
            self.outputs,
            self.loras,
        )
        self.overlap = Overlap(
            self.executor,
            self.scheduler,
            enabled=overlap_default(config) and proposer is None and self.evictor is None,
        )
        _log_pool(
            self.cache_config,
            config,
            shard_nbytes(self.runner.cache),
            self.max_model_len,
            len(local),
            ring,
        )
        self.warmup_report = None  # set by warm-up, when on
        if config.warmup:
            if self.draft is not None:
                self.draft.warm_up()
            self.warmup_report = self.runner.warm_up()
            log.info(
                "jaxkv: warm-up made %(programs)d programs ready in %(seconds).1f s "
                "(%(loaded)d from the program cache)",
                self.warmup_report,
            )

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m-instruct", **config: Any) -> LLMEngine:
        """Load a model by name or path (HF folder, GGUF file, jaxkv checkpoint)."""
        from checkpoints.known_models import ships_as_gguf
        from checkpoints.loader import load_model
        from jaxkv.model.blocks import keep_gguf_blocks

        cfg = EngineConfig(**config)
        init_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
        module, tokenizer = load_model(
            model,
            dtype=cfg.dtype,
            quantize=cfg.quantize,
            verify_checksums=cfg.verify_checksums,
            gguf_blocks=keep_gguf_blocks(cfg, ships_as_gguf(model)),
        )
        return cls(module, tokenizer, cfg)

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> str:
        """Queue a request: a string, a list of token ids, or
        {"prompt": str} / {"prompt_token_ids": [...]}. Returns its id. A bad
        request is not raised: it finishes at once with finish_reason
        "error" and a message naming the field, reported by the next step().
        `cache_salt`: requests share prefix-cache pages only with requests
        of the same salt (one per tenant). `lora_request`: a
        `jaxkv.core.adapters.lora.LoRARequest` (or a known adapter's name) to run with."""
        return self.intake.add(
            prompt, params, request_id, cache_salt=cache_salt, lora_request=lora_request
        )

    def check_request(
        self, prompt, params: SamplingParams, cache_salt: str | None = None
    ) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a request this engine would
        accept, else ValueError naming the field. Reads only the engine's
        fixed settings, so a server's handler threads may call it."""
        return self.intake.check(prompt, params, cache_salt)

    def abort(self, request_id: str) -> None:
        """Stop a request; its next output has finish_reason "abort"."""
        self.intake.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.intake.reports)

    def get_request(self, request_id: str) -> Sequence:
        """The host state of a request not yet reported finished."""
        return self.intake.seqs[str(request_id)]

    # ------------------------------------------------------------ processes

    def follow(self) -> bool:
        """Processes 1..n-1 of a job: run the steps process 0 sends until it
        stops (its `shutdown` or exit), then True; False at once on process 0."""
        if self.follower is None:
            return False
        self.follower.run(self.runner)
        return True

    def shutdown(self) -> None:
        """Write the prefix cache to the disk tier when there is one (for the
        next start); process 0 of several: release the followers (also done
        at exit)."""
        persist(self.runner, self.tier, self.bm)
        if self.runner.leader is not None:
            self.runner.leader.stop()

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
        outputs = [self._output(s) for s in self.intake.take_reports()]
        ov = self.overlap
        prev, ov.inflight = ov.inflight, None
        if prev is not None:
            if ov.allowed():
                sched = self.scheduler.schedule(lookahead=True)
                if sched.needs_preemption:  # its reservations stay for the plan below
                    self.executor.apply_copies(sched)
                elif sched.scheduled:
                    ov.inflight = ov.dispatch(sched, prev)
                    self.stats["overlapped_steps"] += 1
            res = ov.read(prev)
            outputs += self._finish_step(prev.sched.scheduled, res, prev.stuck)
            if ov.inflight is not None:
                return outputs
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished() and not outputs:
                raise RuntimeError(
                    "scheduler made no progress: the page pool is too small for any waiting request"
                )
            return outputs
        if ov.allowed():
            ov.inflight = ov.dispatch(sched, None)
        else:
            outputs += self._run(sched)
        return outputs

    def _num_programs(self) -> int:
        """Programs ready so far (the draft's too): a step that compiled
        one says nothing about what a step costs."""
        return len(self.runner.compiled) + (len(self.draft.compiled) if self.draft else 0)

    def speculative_metrics(self) -> dict:
        """Speculative decoding so far ({} when off): verify steps, drafts,
        proposed and accepted tokens, acceptance rate, mean accepted length,
        and the seconds spent proposing with their share of step time."""
        return {} if self.spec is None else self.spec.metrics(self.stats["step_seconds"])

    def kv_metrics(self) -> dict:
        """The KV tiers' figures so far (`jaxkv.core.kv.tiers.tier_metrics`)
        and importance eviction's; {} with neither."""
        return {
            **tier_metrics(self.tier, self.config.page_size),
            **(self.evictor.metrics() if self.evictor else {}),
        }

    def flush_cache(self) -> dict:
        """Forget the cached pages no request holds, and the host tier's
        pages (not the disk tier's): {"device_pages": n, "host_pages": m}."""
        host = self.tier.clear() if self.tier is not None else 0
        return {"device_pages": self.bm.flush(), "host_pages": host}

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Run a planned step now and read it (no overlap)."""
        self.executor.apply_copies(sched)
        scored = [sc for sc in sched.scheduled if sc.seq.scores_prompt(sc.start)]
        plain = (
            [sc for sc in sched.scheduled if not sc.seq.scores_prompt(sc.start)]
            if scored
            else sched.scheduled
        )
        touched: dict[int, Sequence] = {}
        if plain:
            t0 = time.perf_counter()
            res, stuck = self.executor.run(plain, sched.num_steps)
            if self.spec is not None:
                self.spec.after_step(plain, res, time.perf_counter() - t0)
            self._take(plain, res, stuck, touched)
        for sc in scored:  # prompt chunks with prompt log-probabilities
            score, stuck = self.executor.score(sc)
            self.outputs.prompt_logprobs(
                sc.seq,
                sc.start,
                sc.num_rows,
                score.target_logprobs,
                score.top_ids,
                score.top_logprobs,
            )
            self._take([sc], score.step, stuck, touched)
        if self.evictor is not None:  # cut what went over its budget
            self.evictor.after_step(sched.scheduled)
        self.stats["steps"] += 1
        return [self._output(p) for p in touched.values()]

    def _take(self, scheduled, res: StepResult, stuck: list[int], touched: dict) -> None:
        for s in self.outputs.take_step(scheduled, res, stuck, touched):
            self.intake.fork(s)

    def _finish_step(self, scheduled, res: StepResult, stuck: list[int]) -> list[RequestOutput]:
        """Hand a step read from flight on (its outputs)."""
        touched: dict[int, Sequence] = {}
        self._take(scheduled, res, stuck, touched)
        self.stats["steps"] += 1
        return [self._output(p) for p in touched.values()]

    def _output(self, s: Sequence) -> RequestOutput:
        """The request's output (all its sequences); `s` is its parent."""
        if all(c.finished for c in s.children):  # its final output: the engine forgets it
            self.intake.forget(s)
        return self.outputs.output(s)

    def run_to_completion(
        self, request_ids: Iterable[str] | None = None, progress=None
    ) -> dict[str, RequestOutput]:
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
        if self.spec is not None:
            log.info("jaxkv: speculative decoding: %s", self.speculative_metrics())
        return final


def _engine_cache(model, cache_config, sharding):
    """(the engine's empty KV cache, the checkpoint's fp8 KV scales [L, 2]
    or None). An fp8 cache takes the checkpoint's scales when it carries
    them (then nothing is calibrated); other formats ignore them."""
    cache = create_cache(
        model.config, cache_config, sharding.cache_sharding() if sharding else None
    )
    kv_scales = model.kv_cache_scales() if cache.quantized else None
    if kv_scales is not None:
        if not cache.fp8:
            log.info(
                "the checkpoint's fp8 KV scales are not used by a %s cache", cache_config.kv_dtype
            )
        else:
            cache = preset_fp8_scales(cache, kv_scales)
            log.info(
                "fp8 KV scales from the checkpoint (k_scale, v_scale of %d layers)", len(kv_scales)
            )
    return cache, kv_scales


def _log_pool(cache_config, config, nbytes: int, max_len: int, num_local: int, ring: int) -> None:
    """Log the engine's pool: pages, tokens, bytes per device, max_model_len."""
    pool_tokens = (cache_config.num_pages - 1) * cache_config.page_size
    log.info(
        "jaxkv: KV cache %d pages x %d tokens = %d tokens (%s, %.1f MiB per device "
        "on %d); max_model_len %d; up to %d sequences at full length",
        cache_config.num_pages,
        cache_config.page_size,
        pool_tokens,
        cache_config.kv_dtype,
        nbytes / 2**20,
        config.tensor_parallel_size,
        max_len,
        max(1, pool_tokens // max_len),
    )
    if ring:
        log.info(
            "jaxkv: hybrid KV pool: %d sliding layers keep a ring of %d pages per seat "
            "(%d local pages)",
            num_local,
            ring,
            cache_config.local_pages,
        )
