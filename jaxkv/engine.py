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
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Iterable

import jax
import numpy as np

from jaxkv.block_manager import BlockManager
from jaxkv.config import CacheConfig, EngineConfig, ModelConfig
from jaxkv.kv_cache import create_cache
from jaxkv.memory import pages_for_budget
from jaxkv.runner import Buckets, Runner, SeqInput
from jaxkv.scheduler import Scheduler
from jaxkv.sequence import (CompletionOutput, Logprob, RequestOutput, SamplingParams,
                            Sequence)

log = logging.getLogger("jaxkv")

def _free_device_memory() -> int | None:
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - CPU backends may not report
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def enable_compilation_cache() -> None:
    """Keep compiled steps across runs in $JAXKV_CACHE/xla (unless the user
    set JAX's own cache directory): a second run of the same model and
    buckets skips most of XLA's compile time."""
    if jax.config.jax_compilation_cache_dir:
        return
    from jaxkv.default_model import default_cache_dir
    path = default_cache_dir() / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


class LLMEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        enable_compilation_cache()
        self.model_config: ModelConfig = model.config
        self.tokenizer = tokenizer
        kv_dtype = config.kv_dtype or config.dtype
        num_pages = self._plan_pages(kv_dtype)
        self.cache_config = CacheConfig(num_pages=num_pages, page_size=config.page_size,
                                        kv_dtype=kv_dtype)
        pool_tokens = (num_pages - 1) * config.page_size
        # Attention window: the model's own (Mistral), or streaming eviction's
        # recent window beside a few sink tokens. Pages that fall out of it
        # go back to the pool while the sequence runs, so a windowed
        # sequence is not capped by the pool.
        self.num_sink_tokens = 0
        self.window = self.model_config.sliding_window
        if config.kv_eviction == "streaming":
            self.window = config.streaming_window
            self.num_sink_tokens = config.num_sink_tokens
        max_pos = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or max_pos, max_pos)
        if self.window is None:
            self.max_model_len = min(self.max_model_len, pool_tokens)
        elif self.window + self.num_sink_tokens + 2 * config.page_size > pool_tokens:
            raise ValueError(f"num_pages: the pool ({pool_tokens} tokens) cannot hold one "
                             f"attention window of {self.window} tokens")
        max_pages = -(-self.max_model_len // config.page_size)
        self.bm = BlockManager(num_pages, config.page_size,
                               enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.bm, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        buckets = Buckets.make(config.max_num_batched_tokens, config.max_num_seqs, max_pages)
        self.runner = Runner(model, create_cache(self.model_config, self.cache_config), buckets,
                             seed=config.seed, attention_backend=config.attention_backend,
                             sliding_window=self.window if config.kv_eviction else None,
                             num_sink_tokens=self.num_sink_tokens)
        self._seqs: dict[str, Sequence] = {}
        self._errors: list[Sequence] = []
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self.stats = dict(steps=0, prompt_tokens_computed=0, generated_tokens=0,
                          prefix_hit_tokens=0)
        log.info("jaxkv: KV cache %d pages x %d tokens = %d tokens (%s, %.1f MiB); "
                 "max_model_len %d; up to %d sequences at full length", num_pages,
                 config.page_size, pool_tokens, kv_dtype,
                 self.runner.cache.nbytes() / 2**20, self.max_model_len,
                 max(1, pool_tokens // self.max_model_len))

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
        from jaxkv.llm import load_model

        cfg = EngineConfig(**config)
        module, tokenizer = load_model(model, dtype=cfg.dtype, quantize=cfg.quantize)
        return cls(module, tokenizer, cfg)

    # ------------------------------------------------------------ requests

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request: a string, a list of token ids, or
        {"prompt": str} / {"prompt_token_ids": [...]}. Returns its id. A bad
        request is not raised: it finishes at once with finish_reason
        "error" and a message naming the field, reported by the next step()."""
        rid = str(request_id) if request_id is not None else str(next(self._ids))
        if rid in self._seqs:
            raise ValueError(f"request_id: {rid!r} is already in use")
        params = params if params is not None else SamplingParams()
        text, ids, err = None, [], None
        try:
            text, ids = self._parse_prompt(prompt)
            if not isinstance(params, SamplingParams):
                raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
            params.validate(self.model_config.vocab_size)
            if params.stop_list and self.tokenizer is None:
                raise ValueError("stop: stop strings need a tokenizer; this model has none")
            if len(ids) + params.max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
                    f"the maximum model length {self.max_model_len}")
        except ValueError as e:
            err = str(e)
            params = params if isinstance(params, SamplingParams) else SamplingParams()
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**31))
        seq = Sequence(rid, text, ids, params, seed)
        self._seqs[rid] = seq
        if err is not None:
            seq.finish("error", error=err)
            self._errors.append(seq)
        else:
            self.scheduler.add(seq)
        return rid

    def _parse_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: empty prompt")
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(t) for t in prompt] if all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt) \
                else None
            if ids is None:
                raise ValueError("prompt_token_ids: must be a list of integers")
            if not ids:
                raise ValueError("prompt_token_ids: empty prompt")
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt_token_ids: unknown token id {bad[0]} "
                                 f"(vocab size {self.model_config.vocab_size})")
            return None, ids
        raise ValueError(f"prompt: expected str, token ids or dict, got {type(prompt).__name__}")

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
        burst = self._burst_size()
        if burst > 1:
            return outputs + self._decode_burst(burst)
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.has_unfinished() and not outputs:
                raise RuntimeError("scheduler made no progress: the page pool is too small "
                                   "for any waiting request")
            return outputs
        self.runner.copy_pages(sched.copies)
        inputs = [self._seq_input(sc) for sc in sched.scheduled]
        want_lp = SamplingParams.MAX_LOGPROBS if any(
            sc.seq.params.logprobs is not None and sc.completes for sc in sched.scheduled) else 0
        out, _ = self.runner.run(inputs, num_top_logprobs=want_lp)
        self.stats["steps"] += 1
        for i, sc in enumerate(sched.scheduled):
            s = sc.seq
            self._computed(s, sc.start + sc.num_tokens)
            if len(s.output_token_ids) == 0 or not sc.completes:
                self.stats["prompt_tokens_computed"] += sc.num_tokens
            if not sc.completes:
                continue
            self._accept(s, int(out.token_ids[i]), float(out.logprob[i]), out.top_ids[i],
                         out.top_logprobs[i])
            if s.finished:
                self.scheduler.remove(s)
            outputs.append(self._output(s))
        return outputs

    def _tokens_left(self, s: Sequence) -> int:
        return min(s.params.max_tokens - len(s.output_token_ids),
                   self.max_model_len - s.num_tokens)

    def _burst_size(self) -> int:
        """Decode steps to run in one call: more than one only when every
        running sequence decodes (nothing to prefill that could be
        admitted) and none needs per-step host work (penalties)."""
        sch = self.scheduler
        if self.config.num_decode_steps <= 1 or not sch.running:
            return 1
        if sch.waiting and len(sch.running) < sch.max_num_seqs:
            return 1
        if any(s.num_tokens - s.num_computed != 1 or s.params.uses_penalties
               for s in sch.running):
            return 1
        return self.config.num_decode_steps  # fixed: one compile; the loop ends early

    def _decode_burst(self, num_steps: int) -> list[RequestOutput]:
        sched = self.scheduler.schedule_decode_burst(
            num_steps, {s.request_id: self._tokens_left(s) for s in self.scheduler.running})
        if not sched.scheduled:
            return []
        self.runner.copy_pages(sched.copies)
        inputs, stops = [], []
        want_lp = 0
        for sc in sched.scheduled:
            s, p = sc.seq, sc.seq.params
            inputs.append(self._seq_input(sc))
            ids = list(p.stop_token_ids or ())
            if not p.ignore_eos:
                ids += list(self.model_config.eos_token_ids)
            stops.append((ids, p.min_tokens - len(s.output_token_ids), self._tokens_left(s)))
            if p.logprobs is not None:
                want_lp = SamplingParams.MAX_LOGPROBS
        toks, lps, tids, tlps = self.runner.run_decode(inputs, stops, num_steps,
                                                       num_top_logprobs=want_lp)
        self.stats["steps"] += 1
        self.stats["decode_steps"] = self.stats.get("decode_steps", 0) + len(toks)
        outputs = []
        for i, sc in enumerate(sched.scheduled):
            s = sc.seq
            for k in range(len(toks)):
                self._accept(s, int(toks[k, i]), float(lps[k, i]), tids[k, i], tlps[k, i])
                if s.finished:
                    break
            if s.finished:
                self.scheduler.remove(s)
            else:
                self._computed(s, sc.start + len(toks))
            outputs.append(self._output(s))
        return outputs

    def _seq_input(self, sc) -> SeqInput:
        s, p = sc.seq, sc.seq.params
        toks = s.all_token_ids
        return SeqInput(
            token_ids=toks[sc.start:sc.start + sc.num_tokens], start_pos=sc.start,
            block_table=self.bm.block_table(s.request_id), temperature=p.temperature,
            top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=s.seed,
            sample_index=len(s.output_token_ids), presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
            history=toks if p.uses_penalties else (), num_prompt=len(s.prompt_token_ids))

    def _computed(self, s: Sequence, num_computed: int) -> None:
        """Record K/V written up to num_computed; free pages behind the window."""
        s.num_computed = num_computed
        self.bm.mark_computed(s.request_id, s.all_token_ids, num_computed)
        if self.window is not None:  # the next query sits at num_computed
            self.bm.release_range(s.request_id, self.num_sink_tokens,
                                  num_computed - self.window + 1)

    def _accept(self, s: Sequence, tok: int, logprob: float, top_ids, top_lps) -> None:
        """Append a sampled token and apply the stop rules."""
        s.output_token_ids.append(tok)
        self.stats["generated_tokens"] += 1
        if s.t_first_token is None:
            s.t_first_token = time.perf_counter()
        if s.logprobs is not None:
            n = s.params.logprobs
            s.logprobs.append(Logprob(tok, logprob, {
                int(t): float(v) for t, v in zip(top_ids[:n], top_lps[:n])}))
        self._check_stop(s, tok)

    def _check_stop(self, s: Sequence, tok: int) -> None:
        p = s.params
        n = len(s.output_token_ids)
        if self.tokenizer is not None:
            s.text = self.tokenizer.decode(s.output_token_ids,
                                           skip_special_tokens=p.skip_special_tokens)
        if n >= p.min_tokens:
            if p.stop_token_ids and tok in p.stop_token_ids:
                return s.finish("stop", stop_reason=tok)
            if not p.ignore_eos and tok in self.model_config.eos_token_ids:
                return s.finish("stop", stop_reason=tok)
            for stop in p.stop_list:
                # Only the tail can hold a new match.
                j = s.text.find(stop, max(0, s.sent_text - len(stop)))
                if j >= 0:
                    s.text = s.text[:j]
                    return s.finish("stop", stop_reason=stop)
        if n >= p.max_tokens or s.num_tokens >= self.max_model_len:
            return s.finish("length")

    def _output(self, s: Sequence) -> RequestOutput:
        if s.finished:  # its final output: the engine forgets it
            self._seqs.pop(s.request_id, None)
        text = s.text
        # Hold back an incomplete UTF-8 tail (and a possible stop-string
        # prefix) while streaming; everything is released at the finish.
        visible = len(text)
        if not s.finished:
            if text.endswith("\ufffd"):
                visible = len(text.rstrip("\ufffd"))
            for stop in s.params.stop_list:
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        visible = min(visible, len(text) - k)
                        break
        visible = max(visible, s.sent_text)
        delta_text = text[s.sent_text:visible]
        delta_ids = s.output_token_ids[s.sent_tokens:]
        s.sent_text, s.sent_tokens = visible, len(s.output_token_ids)
        comp = CompletionOutput(index=0, text=text[:visible] if not s.finished else text,
                                token_ids=list(s.output_token_ids),
                                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                                delta_text=delta_text, delta_token_ids=delta_ids)
        metrics = dict(arrival=s.t_arrival, first_token=s.t_first_token, finish=s.t_finish,
                       num_preemptions=s.num_preemptions)
        return RequestOutput(request_id=s.request_id, prompt=s.prompt,
                             prompt_token_ids=list(s.prompt_token_ids), outputs=[comp],
                             finished=s.finished, error=s.error,
                             num_cached_tokens=s.num_cached_tokens, metrics=metrics)

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
