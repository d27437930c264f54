"""From sampled tokens to what users see: each accepted token is appended,
detokenized and checked against the request's stop rule and stop strings;
each output carries the text and tokens new since the previous one
(streaming deltas), holding back an incomplete UTF-8 tail or a possible
stop-string prefix until it is settled."""

from __future__ import annotations

import time

from jaxkv.core.outputs import CompletionOutput, Logprob, RequestOutput
from jaxkv.core.sequence import Sequence


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def accept(self, s: Sequence, tok: int, logprob: float, top_ids, top_lps) -> None:
        """Append a sampled token to `s` and apply its stop rules (it may
        finish)."""
        s.output_token_ids.append(tok)
        if s.t_first_token is None:
            s.t_first_token = time.perf_counter()
        if s.logprobs is not None:
            n = s.params.logprobs
            s.logprobs.append(Logprob(tok, logprob, {
                int(t): float(v) for t, v in zip(top_ids[:n], top_lps[:n])}))
        if self.tokenizer is not None:
            s.text = self.tokenizer.decode(s.output_token_ids,
                                           skip_special_tokens=s.params.skip_special_tokens)
        reason = s.stop.on_token(tok, len(s.output_token_ids))
        if reason == "stop":
            return s.finish("stop", stop_reason=tok)
        if s.rules is not None:
            verdict = s.rules.accept(tok)
            if verdict == "stop":  # the grammar is complete
                return s.finish("stop")
            if verdict is not None:
                return s.finish("error", error=verdict)
        if len(s.output_token_ids) >= s.stop.min_tokens:
            for stop in s.stop.stop_strings:
                # Only the tail can hold a new match.
                j = s.text.find(stop, max(0, s.sent_text - len(stop)))
                if j >= 0:
                    s.text = s.text[:j]
                    return s.finish("stop", stop_reason=stop)
        if reason == "length":
            s.finish("length")

    def prompt_logprobs(self, s: Sequence, start: int, num_rows: int, target_lps, top_ids,
                        top_lps) -> None:
        """Record the prompt log-probabilities of rows [start, start +
        num_rows): row r scores prompt token r + 1 (entries already recorded,
        e.g. before a preemption, are kept)."""
        n = s.params.prompt_logprobs
        prompt = s.prompt_token_ids
        for r in range(num_rows):
            pos = start + r + 1
            if pos >= len(prompt):
                break
            if pos == len(s.prompt_logprobs):
                s.prompt_logprobs.append(Logprob(prompt[pos], float(target_lps[r]), {
                    int(t): float(v) for t, v in zip(top_ids[r, :n], top_lps[r, :n])}))

    def output(self, s: Sequence) -> RequestOutput:
        """The request's output now (one CompletionOutput per sequence of an
        n > 1 request), with the deltas since the last one. `s` is the
        request's parent sequence."""
        comps = [self._completion(c) for c in s.children]
        finished = all(c.finished for c in s.children)
        errors = list(dict.fromkeys(c.error for c in s.children if c.error))
        ends = [c.t_finish for c in s.children if c.t_finish is not None]
        firsts = [c.t_first_token for c in s.children if c.t_first_token is not None]
        metrics = dict(arrival=s.t_arrival, first_token=min(firsts) if firsts else None,
                       finish=max(ends) if finished and ends else None,
                       num_preemptions=sum(c.num_preemptions for c in s.children),
                       spec_proposed=sum(c.spec_proposed for c in s.children),
                       spec_accepted=sum(c.spec_accepted for c in s.children))
        return RequestOutput(request_id=s.request_id, prompt=s.prompt,
                             prompt_token_ids=list(s.prompt_token_ids), outputs=comps,
                             finished=finished, error="; ".join(errors) or None,
                             num_cached_tokens=s.num_cached_tokens, metrics=metrics,
                             prompt_logprobs=list(s.prompt_logprobs)
                             if s.prompt_logprobs is not None
                             and len(s.prompt_logprobs) == len(s.prompt_token_ids) else None)

    def _completion(self, s: Sequence) -> CompletionOutput:
        text = s.text
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
        return CompletionOutput(index=s.index, text=text[:visible] if not s.finished else text,
                                token_ids=list(s.output_token_ids),
                                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                logprobs=list(s.logprobs) if s.logprobs is not None else None,
                                delta_text=delta_text, delta_token_ids=delta_ids)
