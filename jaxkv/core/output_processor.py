"""From sampled tokens to what users see: each accepted token is appended,
detokenized incrementally and checked against the request's stop rule and
stop strings; each output carries what is new since the previous one
(streaming deltas), holding back a possible stop-string prefix until it
is settled, and builds the whole text and token list only when read
(`jaxkv.core.outputs`). Work per token is O(1) in the output's length:
a stop string is looked for only where it could end in the new text.
"""

from __future__ import annotations

import functools
import time

from jaxkv.core.detokenizer import Detokenizer
from jaxkv.core.outputs import CompletionOutput, Logprob, RequestOutput
from jaxkv.core.sequence import Sequence, Status

FINISHED = Status.FINISHED


class TextState:
    """A sequence's output text: its pieces in order (append-only), their
    total length, the last `hold` characters (the longest stop string but
    one, for stop strings ending in the next piece and for holding a
    stop-string prefix back), the text not streamed yet, and where a stop
    string cut it."""

    __slots__ = ("detok", "pieces", "length", "tail", "unsent", "sent", "end", "hold")

    def __init__(self, detok: Detokenizer, stop_strings):
        self.detok = detok
        self.pieces: list[str] = []
        self.length = 0
        self.tail = ""
        self.unsent = ""
        self.sent = 0
        self.end: int | None = None
        self.hold = max((len(x) for x in stop_strings), default=1) - 1

    def add(self, piece: str) -> tuple[str, int]:
        """Append `piece`; returns (the tail before it + the piece, the
        text position of that window's first character)."""
        window = self.tail + piece
        start = self.length - len(self.tail)
        self.pieces.append(piece)
        self.length += len(piece)
        self.unsent += piece
        self.tail = window[-self.hold :] if self.hold else ""
        return window, start


def _join(pieces: list[str], n: int, chars: int) -> str:
    return "".join(pieces[:n])[:chars]


def _prefix(items: list, n: int) -> list:
    return items[:n]


class OutputProcessor:
    """`scheduler` takes each sequence's progress after a step; `stats`
    is the engine's counters (generated and prompt tokens, model calls)."""

    def __init__(self, tokenizer, scheduler=None, stats: dict | None = None):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.stats = stats if stats is not None else {}

    def take_step(self, scheduled, res, stuck: list[int], touched: dict) -> list[Sequence]:
        """Take a step's result (`jaxkv.worker.plan.StepResult` of
        `scheduled`): each sequence's sampled tokens, in order, and its
        progress handed to the scheduler; the requests with news go into
        `touched` (by id). Returns the sequences whose prefill reached a
        pending n > 1 fork."""
        stats, sched, accept = self.stats, self.scheduler, self.accept
        verified = any(sc.spec_tokens for sc in scheduled)
        stats["decode_steps"] += 1 if verified else len(res.tokens)
        counts = res.counts.tolist()
        tokens = res.tokens.T.tolist()  # [S][n]
        logprobs = res.logprobs.T.tolist()
        finite = res.finite.T.tolist()
        forks = []
        generated = 0
        for i, sc in enumerate(scheduled):
            s = sc.seq
            if s.status is FINISHED:  # finished (or aborted) while this step was in flight
                continue
            if not sc.completes:  # a prefill chunk short of the prompt's end
                stats["prompt_tokens_computed"] += sc.num_rows
                stats["partial_prefills"] += 1
                if sched.chunk_ran(sc):
                    forks.append(s)
                continue
            if not s.num_output_tokens:
                stats["prompt_tokens_computed"] += sc.num_rows
            sched.chunk_ran(sc)
            count = counts[i]
            if stuck and i in stuck:
                count = 0
                why = getattr(s.rules, "error", None) or "the rules allow none"
                s.finish(
                    "error", error=f"structured_outputs: no token can continue the output ({why})"
                )
            toks, lps, fin = tokens[i], logprobs[i], finite[i]
            for k in range(count):
                if not fin[k]:
                    s.finish(
                        "error",
                        error=f"logits: not finite (NaN or inf) at output token "
                        f"{s.num_output_tokens}: the model's weights or "
                        "activations overflow",
                    )
                    break
                if s.logprobs is None:
                    accept(s, toks[k], lps[k])
                else:
                    accept(s, toks[k], lps[k], res.top_ids[k, i], res.top_logprobs[k, i])
                generated += 1
                if s.status is FINISHED:
                    break
            sched.tokens_taken(sc, counts[i])
            touched[id(s.parent)] = s.parent
        stats["generated_tokens"] += generated
        return forks

    def start(self, s: Sequence) -> None:
        """Ready a queued sequence's text state (with a tokenizer)."""
        if self.tokenizer is not None:
            s.text = TextState(
                Detokenizer(self.tokenizer, s.params.skip_special_tokens), s.params.stop_list
            )

    def accept(self, s: Sequence, tok: int, logprob: float, top_ids=None, top_lps=None) -> None:
        """Append a sampled token to `s` and apply its stop rules (it may
        finish)."""
        s.append_token(tok)
        if s.t_first_token is None:
            s.t_first_token = time.perf_counter()
        if s.logprobs is not None:
            n = s.params.logprobs
            s.logprobs.append(
                Logprob(tok, logprob, dict(zip(top_ids[:n].tolist(), top_lps[:n].tolist())))
            )
        ts = s.text
        piece = ts.detok.step(tok) if ts is not None else ""
        reason = s.stop.on_token(tok, s.num_output_tokens)
        if piece:
            window, start = ts.add(piece)
        if reason == "stop":
            return self._finish(s, "stop", stop_reason=tok)
        if s.rules is not None:
            verdict = s.rules.accept(tok)
            if verdict == "stop":  # the grammar is complete
                return self._finish(s, "stop")
            if verdict is not None:
                return self._finish(s, "error", error=verdict)
        if piece and s.stop.stop_strings and s.num_output_tokens >= s.stop.min_tokens:
            for stop in s.stop.stop_strings:
                # Only a match ending in the new piece is new.
                j = window.find(stop, max(0, len(window) - len(piece) - len(stop) + 1))
                if j >= 0:
                    ts.end = start + j
                    return self._finish(s, "stop", stop_reason=stop)
        if reason == "length":
            self._finish(s, "length")

    def _finish(self, s: Sequence, reason: str, stop_reason=None, error=None) -> None:
        ts = s.text
        if ts is not None:
            rest = ts.detok.flush()
            if rest:
                ts.add(rest)
        s.finish(reason, stop_reason=stop_reason, error=error)

    def prompt_logprobs(
        self, s: Sequence, start: int, num_rows: int, target_lps, top_ids, top_lps
    ) -> None:
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
                s.prompt_logprobs.append(
                    Logprob(
                        int(prompt[pos]),
                        float(target_lps[r]),
                        {int(t): float(v) for t, v in zip(top_ids[r, :n], top_lps[r, :n])},
                    )
                )

    def output(self, s: Sequence) -> RequestOutput:
        """The request's output now (one CompletionOutput per sequence of an
        n > 1 request), with the deltas since the last one. `s` is the
        request's parent sequence."""
        children = s.children
        if len(children) == 1:
            comps = [self._completion(s)]
            finished = s.finished
            errors = [s.error] if s.error else []
            first = s.t_first_token
            metrics = dict(
                arrival=s.t_arrival,
                first_token=first,
                finish=s.t_finish if finished else None,
                num_preemptions=s.num_preemptions,
                spec_proposed=s.spec_proposed,
                spec_accepted=s.spec_accepted,
            )
        else:
            comps = [self._completion(c) for c in children]
            finished = all(c.finished for c in children)
            errors = list(dict.fromkeys(c.error for c in children if c.error))
            ends = [c.t_finish for c in children if c.t_finish is not None]
            firsts = [c.t_first_token for c in children if c.t_first_token is not None]
            metrics = dict(
                arrival=s.t_arrival,
                first_token=min(firsts) if firsts else None,
                finish=max(ends) if finished and ends else None,
                num_preemptions=sum(c.num_preemptions for c in children),
                spec_proposed=sum(c.spec_proposed for c in children),
                spec_accepted=sum(c.spec_accepted for c in children),
            )
        plp = s.prompt_logprobs
        return RequestOutput(
            request_id=s.request_id,
            prompt=s.prompt,
            prompt_token_ids=s.prompt_token_ids.tolist,
            outputs=comps,
            finished=finished,
            error="; ".join(errors) or None,
            num_cached_tokens=s.num_cached_tokens,
            metrics=metrics,
            prompt_logprobs=functools.partial(_prefix, plp, len(plp))
            if plp is not None and len(plp) == s.num_prompt_tokens
            else None,
        )

    def _completion(self, s: Sequence) -> CompletionOutput:
        ts = s.text
        if ts is None:
            delta_text, text = "", ""
        else:
            visible = ts.length
            if s.finished:
                if ts.end is not None:
                    visible = ts.end
            elif ts.tail:
                for stop in s.params.stop_list:
                    for k in range(min(len(stop) - 1, len(ts.tail)), 0, -1):
                        if ts.tail.endswith(stop[:k]):
                            visible = min(visible, ts.length - k)
                            break
            chars = visible if s.finished else max(visible, ts.sent)
            new = max(visible, ts.sent) - ts.sent
            delta_text, ts.unsent = ts.unsent[:new], ts.unsent[new:]
            ts.sent += new
            text = functools.partial(_join, ts.pieces, len(ts.pieces), chars)
        out = s.output_token_ids
        delta_ids = out[s.sent_tokens :].tolist()
        s.sent_tokens = s.num_output_tokens
        lps = s.logprobs
        delta_lps = None
        if lps is not None:
            delta_lps = lps[s.sent_logprobs :]
            s.sent_logprobs = len(lps)
            lps = functools.partial(_prefix, lps, len(lps))
        return CompletionOutput(
            index=s.index,
            text=text,
            token_ids=out.tolist,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
            logprobs=lps,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            delta_logprobs=delta_lps,
        )
