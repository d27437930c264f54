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
tokens into outputs.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Iterable

import numpy as np

from jaxkv.config import CacheConfig, EngineConfig, ModelConfig
from jaxkv.core.block_manager import BlockManager
from jaxkv.core.output_processor import OutputProcessor
from jaxkv.core.outputs import RequestOutput
from jaxkv.core.requests import check_request, child_seed, parse_prompt
from jaxkv.core.sampling_params import SamplingParams, is_unicode
from jaxkv.core.scheduler import Scheduler, SchedulerOutput
from jaxkv.core.sequence import Sequence
from jaxkv.core.structured import Grammars, TokenRules
from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import create_cache
from jaxkv.model.memory import max_model_len, plan_num_pages
from jaxkv.sharding import shard_nbytes
from jaxkv.worker.distributed import init_distributed, scale_out
from jaxkv.worker.runner import Runner
from jaxkv.worker.execute import execute, execute_scored
from jaxkv.worker.buckets import Buckets
from jaxkv.worker.stop import StopRule

log = logging.getLogger("jaxkv")


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
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
        self.scheduler = Scheduler(self.bm, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   max_num_steps=config.num_decode_steps)
        buckets = Buckets.make(config.max_num_seqs, config.max_num_batched_tokens,
                               -(-self.max_model_len // config.page_size), self.max_model_len)
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
        # decode_steps: model calls; partial_prefills: chunks short of the prompt's end.
        self.stats = dict(steps=0, decode_steps=0, prompt_tokens_computed=0, generated_tokens=0,
                          partial_prefills=0)
        log.info("jaxkv: KV cache %d pages x %d tokens = %d tokens (%s, %.1f MiB per device "
                 "on %d); max_model_len %d; up to %d sequences at full length", num_pages,
                 config.page_size, pool_tokens, kv_dtype, shard_nbytes(self.runner.cache)
                 / 2**20, config.tensor_parallel_size, self.max_model_len,
                 max(1, pool_tokens // self.max_model_len))
        self.warmup_report = None
        if config.warmup:
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
            seq.rules = self._rules(params)
            self.scheduler.add(seq)
            if params.n > 1:  # share the prompt's full pages if it has any
                if len(ids) - 1 >= self.config.page_size:
                    seq.fork_pending = True
                else:
                    for i in range(1, params.n):
                        self.scheduler.add(self._child(seq, i))
        return rid

    def _rules(self, params: SamplingParams) -> TokenRules | None:
        if not params.uses_rules:
            return None
        return TokenRules(params, self.grammars, self.tokenizer, self.model_config.vocab_size)

    def _child(self, parent: Sequence, i: int) -> Sequence:
        return parent.add_child(i, child_seed(parent.seed, i), self._rules(parent.params))

    def _fork(self, parent: Sequence) -> None:
        """The parent computed all but its last prompt token: its n - 1
        siblings share those pages and each runs the last token itself."""
        parent.fork_pending = False
        self.scheduler.fork(parent, [self._child(parent, i) for i in range(1, parent.params.n)])

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
        if params.n > c.max_num_seqs:
            raise ValueError(f"n: {params.n} sequences exceed max_num_seqs {c.max_num_seqs}")
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)  # compiles (cached) or names the error
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer")
        return text, ids

    def abort(self, request_id: str) -> None:
        """Stop a request; its next output has finish_reason "abort"."""
        seq = self._seqs.get(str(request_id))
        if seq is None or all(c.finished for c in seq.children):
            return
        for c in seq.children:
            if not c.finished:
                self.scheduler.remove(c)
                c.finish("abort")
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
        V = self.model_config.vocab_size
        scored = [sc for sc in sched.scheduled if sc.seq.scores_prompt(sc.start)]
        plain = [sc for sc in sched.scheduled if id(sc) not in {id(x) for x in scored}]
        touched: dict[int, Sequence] = {}
        if plain:
            res, stuck = execute(self.runner, plain, sched.num_steps, V)
            self._accept(plain, res, stuck, touched)
        for sc in scored:  # prompt chunks with prompt log-probabilities
            tgt, top_ids, top_lps, res, stuck = execute_scored(self.runner, sc, V)
            self.outputs.prompt_logprobs(sc.seq, sc.start, sc.num_tokens, tgt, top_ids, top_lps)
            self._accept([sc], res, stuck, touched)
        self.stats["steps"] += 1
        return [self._output(p) for p in touched.values()]

    def _accept(self, scheduled, res, stuck: list[int], touched: dict) -> None:
        """Hand each sequence's sampled tokens to the output processor."""
        self.stats["decode_steps"] += len(res.tokens)
        for i, sc in enumerate(scheduled):
            s = sc.seq
            if not sc.completes:  # a prefill chunk short of the prompt's end
                self.stats["prompt_tokens_computed"] += sc.num_tokens
                self.stats["partial_prefills"] += 1
                self._computed(s, sc.start + sc.num_tokens)
                if s.fork_pending and sc.start + sc.num_tokens == s.prefill_target:
                    self._fork(s)
                continue
            if not s.output_token_ids:
                self.stats["prompt_tokens_computed"] += sc.num_tokens
            self._computed(s, sc.start + sc.num_tokens)
            if i in stuck:
                s.finish("error", error="structured_outputs: no token can continue the "
                                        "output (the rules allow none)")
            for k in range(0 if i in stuck else len(res.tokens)):
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
            touched[id(s.parent)] = s.parent

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
        return final
