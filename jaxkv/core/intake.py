"""The request side of `jaxkv.core.engine.LLMEngine`: checking a request,
queueing it (a refused one finishes at once with its error), its n > 1
siblings, aborts. A mixin: it reads the engine's scheduler, tokenizer,
grammars and settings."""

from __future__ import annotations

from jaxkv.core.requests import check_request, child_seed, parse_prompt
from jaxkv.core.sampling_params import SamplingParams, is_unicode
from jaxkv.core.sequence import Sequence
from jaxkv.core.structured import TokenRules
from jaxkv.worker.stop import StopRule


class RequestIntake:
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
