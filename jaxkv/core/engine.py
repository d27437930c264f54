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
`build_step_batch` packs it, the runner runs it, the output processor
turns tokens into outputs.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterable

import jax
import numpy as np

from jaxkv.config import CacheConfig, EngineConfig, ModelConfig
from jaxkv.core.block_manager import BlockManager
from jaxkv.core.output_processor import OutputProcessor
from jaxkv.core.outputs import RequestOutput
from jaxkv.core.requests import check_request, parse_prompt
from jaxkv.core.sampling_params import SamplingParams, is_unicode
from jaxkv.core.scheduler import Scheduler, SchedulerOutput
from jaxkv.core.sequence import Sequence
from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import create_cache
from jaxkv.model.memory import pages_for_budget
from jaxkv.worker.runner import Runner
from jaxkv.worker.step_batch import Buckets, build_penalty_batch, build_step_batch
from jaxkv.worker.stop import StopRule

log = logging.getLogger("jaxkv")


def _free_device_memory() -> int | None:
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - CPU backends may not report
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        kv_dtype = config.kv_dtype or config.dtype
        num_pages = self._plan_pages(kv_dtype)
        self.cache_config = CacheConfig(num_pages=num_pages, page_size=config.page_size,
                                        kv_dtype=kv_dtype)
        pool_tokens = (num_pages - 1) * config.page_size
        # Pages that fall out of the attention window go back to the pool
        # while the sequence runs, so a windowed sequence is not capped by
        # the pool.
        self.attention = AttentionSpec.for_engine(self.model_config, config)
        window, sinks = self.attention.sliding_window, self.attention.num_sink_tokens
        max_pos = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or max_pos, max_pos)
        if window is None:
            self.max_model_len = min(self.max_model_len, pool_tokens)
        elif window + sinks + 2 * config.page_size > pool_tokens:
            raise ValueError(f"num_pages: the pool ({pool_tokens} tokens) cannot hold one "
                             f"attention window of {window} tokens")
        self.bm = BlockManager(num_pages, config.page_size,
                               enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.bm, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   max_num_steps=config.num_decode_steps)
        buckets = Buckets.make(config.max_num_seqs, config.max_num_batched_tokens,
                               -(-self.max_model_len // config.page_size), self.max_model_len)
        self.runner = Runner(model, create_cache(self.model_config, self.cache_config), buckets,
                             self.attention, max_decode_steps=config.num_decode_steps,
                             num_top_logprobs=SamplingParams.MAX_LOGPROBS, seed=config.seed)
        self.outputs = OutputProcessor(tokenizer)
        self._seqs: dict[str, Sequence] = {}
        self._errors: list[Sequence] = []
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        # steps: engine steps run; decode_steps: model calls (a multi-step
        # decode call counts each); partial_prefills: prompt chunks that
        # stopped short of the prompt's end (chunked prefill).
        self.stats = dict(steps=0, decode_steps=0, prompt_tokens_computed=0, generated_tokens=0,
                          partial_prefills=0)
        log.info("jaxkv: KV cache %d pages x %d tokens = %d tokens (%s, %.1f MiB); "
                 "max_model_len %d; up to %d sequences at full length", num_pages,
                 config.page_size, pool_tokens, kv_dtype,
                 self.runner.cache.nbytes() / 2**20, self.max_model_len,
                 max(1, pool_tokens // self.max_model_len))
        self.warmup_report = None
        if config.warmup:
            self.warmup_report = self.runner.warm_up()
            log.info("jaxkv: warm-up compiled %d programs in %.1f s",
                     self.warmup_report["programs"], self.warmup_report["seconds"])

    def _plan_pages(self, kv_dtype: str) -> int:
        c = self.config
        if c.num_pages is not None:
            return c.num_pages
        budget = c.kv_cache_memory
        if budget is None:
            free = _free_device_memory()
            budget = int(free * c.gpu_memory_utilization) if free else 1 << 30
        m = self.model_config
        pages = pages_for_budget(budget, m.num_layers, m.num_kv_heads, m.head_dim, c.page_size,
                                 kv_dtype)
        if pages < 2:
            raise ValueError(f"kv_cache_memory: {budget} bytes hold fewer than 2 KV pages")
        return int(pages)

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m-instruct", **config: Any) -> "LLMEngine":
        """Load a model by name or path (HF folder, GGUF file, jaxkv checkpoint)."""
        from checkpoints.loader import load_model

        cfg = EngineConfig(**config)
        module, tokenizer = load_model(model, dtype=cfg.dtype, quantize=cfg.quantize)
        return cls(module, tokenizer, cfg)

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    request_id: str | None = None, *, cache_salt: str | None = None) -> str:
        """Queue a request: a string, a list of token ids, or
        {"prompt": str} / {"prompt_token_ids": [...]}. Returns its id. A bad
        request is not raised: it finishes at once with finish_reason
        "error" and a message naming the field, reported by the next step().
        `cache_salt`: requests share prefix-cache pages only with requests
        of the same salt (one per tenant)."""
        if request_id is None:
            rid = str(next(self._ids))
            while rid in self._seqs:  # a caller chose this id
                rid = str(next(self._ids))
        else:
            rid = str(request_id)
        if rid in self._seqs:
            raise ValueError(f"request_id: {rid!r} is already in use")
        params = params if params is not None else SamplingParams()
        text, ids, err = None, [], None
        try:
            text, ids = self.check_request(prompt, params, cache_salt)
        except (ValueError, TypeError) as e:
            # A TypeError is a check that named no field: still the request's error.
            err = str(e) if isinstance(e, ValueError) else f"request: {e}"
            params = params if isinstance(params, SamplingParams) else SamplingParams()
            ids = ids if isinstance(ids, list) else []
            cache_salt = None
        seed = params.seed if isinstance(params.seed, int) else int(self._seed_rng.integers(2**31))
        seq = Sequence(rid, text, ids, params, seed, cache_salt=cache_salt)
        self._seqs[rid] = seq
        if err is not None:
            seq.finish("error", error=err)
            self._errors.append(seq)
        else:
            seq.stop = StopRule.for_request(params, self.model_config.eos_token_ids, len(ids),
                                            self.max_model_len)
            self.scheduler.add(seq)
        return rid

    def check_request(self, prompt, params: SamplingParams,
                      cache_salt: str | None = None) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of a request this engine would
        accept, else ValueError naming the field. Reads only the engine's
        fixed settings, so a server's handler threads may call it."""
        text, ids = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
        c = self.config
        check_request(ids, params, vocab_size=self.model_config.vocab_size,
                      max_model_len=self.max_model_len, has_tokenizer=self.tokenizer is not None,
                      max_prefill=None if c.enable_chunked_prefill else c.max_num_batched_tokens)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt
                                       or not is_unicode(cache_salt)):
            raise ValueError(f"cache_salt: must be a non-empty string, got {cache_salt!r}")
        return text, ids

    def abort(self, request_id: str) -> None:
        """Stop a request; its next output has finish_reason "abort"."""
        seq = self._seqs.get(str(request_id))
        if seq is None or seq.finished:
            return
        self.scheduler.remove(seq)
        seq.finish("abort")
        self._errors.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._errors)

    def get_request(self, request_id: str) -> Sequence:
        """The host state of a request not yet reported finished."""
        return self._seqs[str(request_id)]

    # ------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one step; return an output for every request that produced
        tokens or finished."""
        outputs = [self._output(s) for s in self._errors]
        self._errors.clear()
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished() and not outputs:
                raise RuntimeError("scheduler made no progress: the page pool is too small "
                                   "for any waiting request")
            return outputs
        return outputs + self._run(sched)

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        self.runner.copy_pages(sched.copies)
        scheduled = sched.scheduled
        batch, key = build_step_batch(scheduled, sched.num_steps, self.runner.page_size,
                                      self.runner.buckets)
        penalties = build_penalty_batch(scheduled, key.seqs, self.runner.buckets)
        res = self.runner.step(batch, key, len(scheduled), penalties)
        self.stats["steps"] += 1
        self.stats["decode_steps"] += len(res.tokens)
        outputs = []
        for i, sc in enumerate(scheduled):
            s = sc.seq
            if not sc.completes:  # a prefill chunk short of the prompt's end
                self.stats["prompt_tokens_computed"] += sc.num_tokens
                self.stats["partial_prefills"] += 1
                self._computed(s, sc.start + sc.num_tokens)
                continue
            if not s.output_token_ids:
                self.stats["prompt_tokens_computed"] += sc.num_tokens
            self._computed(s, sc.start + sc.num_tokens)
            for k in range(len(res.tokens)):
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
            elif len(res.tokens) > 1:  # every token but the newest has its K/V written
                self._computed(s, s.num_tokens - 1)
            outputs.append(self._output(s))
        return outputs

    def _computed(self, s: Sequence, num_computed: int) -> None:
        """Record K/V written up to num_computed; free pages behind the window."""
        self.bm.mark_computed(s.request_id, s.all_token_ids, num_computed)
        window = self.attention.sliding_window
        if window is not None:  # the next query sits at num_computed
            self.bm.release_range(s.request_id, self.attention.num_sink_tokens,
                                  num_computed - window + 1)

    def _output(self, s: Sequence) -> RequestOutput:
        if s.finished:  # its final output: the engine forgets it
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
                new += len(o.outputs[0].delta_token_ids)
                if o.finished and (wanted is None or o.request_id in wanted):
                    final[o.request_id] = o
            if progress is not None:
                progress(len(final), new)
            if wanted is not None and wanted <= final.keys():
                break
        return final
