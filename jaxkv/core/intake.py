"""The request side of the engine: checking a request, queueing it (a
refused one finishes at once with its error), its n > 1 siblings, aborts,
and which requests the engine still holds.

`RequestIntake` is given what it reads by its constructor (the settings,
the tokenizer, the grammars, the scheduler it queues into, the output
processor that readies each sequence's text) and owns the table of
requests by id and the list of requests to report (refused or aborted).
"""

from __future__ import annotations

import itertools

import numpy as np

from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.plan_builder import seq_row
from jaxkv.core.requests import check_request, child_seed, parse_prompt
from jaxkv.core.sampling_params import SamplingParams, is_unicode
from jaxkv.core.sequence import Sequence
from jaxkv.core.structured import TokenRules
from jaxkv.worker.stop import StopRule


class RequestIntake:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        tokenizer,
        grammars,
        scheduler,
        outputs,
        loras=None,
    ):
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.scheduler = scheduler
        self.outputs = outputs
        self.loras = loras  # jaxkv.core.adapters.lora.LoRAAdapters (None: LoRA off)
        self.seqs: dict[str, Sequence] = {}  # requests not yet reported finished
        self.reports: list[Sequence] = []  # refused or aborted: reported by the next step
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)

    def add(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> str:
        """See `LLMEngine.add_request`."""
        if request_id is None:
            rid = str(next(self._ids))
            while rid in self.seqs:  # a caller chose this id
                rid = str(next(self._ids))
        else:
            rid = str(request_id)
        if rid in self.seqs:
            raise ValueError(f"request_id: {rid!r} is already in use")
        params = params if params is not None else SamplingParams()
        text, ids, err, adapter = None, [], None, None
        try:
            text, ids = self.check(prompt, params, cache_salt)
            adapter = self.adapter(lora_request)
        except (ValueError, TypeError) as e:
            # A TypeError is a check that named no field: still the request's error.
            err = str(e) if isinstance(e, ValueError) else f"request: {e}"
            params = params if isinstance(params, SamplingParams) else SamplingParams()
            ids = ids if isinstance(ids, list) else []
            cache_salt = None
        seed = params.seed if isinstance(params.seed, int) else int(self._seed_rng.integers(2**31))
        seq = Sequence(rid, text, ids, params, seed, cache_salt=cache_salt)
        seq.lora = adapter
        self.seqs[rid] = seq
        if err is not None:
            seq.finish("error", error=err)
            self.reports.append(seq)
            return rid
        seq.stop = StopRule.for_request(
            params, self.model_config.eos_token_ids, len(ids), self.max_model_len
        )
        seq.rules = self._rules(params)
        self._ready(seq)
        self.scheduler.add(seq)
        if params.n > 1:  # share the prompt's full pages if it has any
            if len(ids) - 1 >= self.config.page_size:
                seq.fork_pending = True
            else:
                for i in range(1, params.n):
                    self.scheduler.add(self._child(seq, i))
        return rid

    def _ready(self, seq: Sequence) -> None:
        seq.sampling_row = seq_row(seq.params, seq.seed, seq.stop)
        self.outputs.start(seq)

    def _rules(self, params: SamplingParams) -> TokenRules | None:
        if not params.uses_rules:
            return None
        return TokenRules(params, self.grammars, self.tokenizer, self.model_config.vocab_size)

    def _child(self, parent: Sequence, i: int) -> Sequence:
        c = parent.add_child(i, child_seed(parent.seed, i), self._rules(parent.params))
        self._ready(c)
        return c

    def fork(self, parent: Sequence) -> None:
        """The parent computed all but its last prompt token: its n - 1
        siblings share those pages and each runs the last token itself."""
        parent.fork_pending = False
        self.scheduler.fork(parent, [self._child(parent, i) for i in range(1, parent.params.n)])

    def check(
        self, prompt, params: SamplingParams, cache_salt: str | None = None
    ) -> tuple[str | None, list[int]]:
        """See `LLMEngine.check_request`."""
        text, ids = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
        c = self.config
        check_request(
            ids,
            params,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            has_tokenizer=self.tokenizer is not None,
            max_prefill=None if c.enable_chunked_prefill else c.max_num_batched_tokens,
        )
        if cache_salt is not None and (
            not isinstance(cache_salt, str) or not cache_salt or not is_unicode(cache_salt)
        ):
            raise ValueError(f"cache_salt: must be a non-empty string, got {cache_salt!r}")
        if params.n > c.max_num_seqs:
            raise ValueError(f"n: {params.n} sequences exceed max_num_seqs {c.max_num_seqs}")
        if params.n > 1 and c.kv_eviction in ("snapkv", "h2o"):
            raise ValueError(
                f"n: kv_eviction={c.kv_eviction!r} compacts a sequence's pages, "
                f"which n > 1 answers would share; ask for n=1"
            )
        if params.structured_outputs is not None:
            self.grammars.matcher(params.structured_outputs)  # compiles (cached) or names the error
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words: this model has no tokenizer")
        return text, ids

    def adapter(self, lora_request):
        """The `jaxkv.core.adapters.lora.Adapter` a request names (None: the base
        model); ValueError naming what is wrong with it."""
        if lora_request is None:
            return None
        if self.loras is None:
            raise ValueError(
                "lora_request: this engine runs without LoRA (start it with enable_lora=True)"
            )
        return self.loras.resolve(lora_request)

    def abort(self, request_id: str) -> None:
        """Stop a request; its next output has finish_reason "abort"."""
        seq = self.seqs.get(str(request_id))
        if seq is None or all(c.finished for c in seq.children):
            return
        for c in seq.children:
            if not c.finished:
                self.scheduler.remove(c)
                c.finish("abort")
        self.reports.append(seq)

    def take_reports(self) -> list[Sequence]:
        out, self.reports = self.reports, []
        return out

    def forget(self, seq: Sequence) -> None:
        """The request's final output went out: the engine no longer holds it."""
        self.seqs.pop(seq.request_id, None)
