"""Continuous batching: what runs in the next step.

Every step, within a token budget and a sequence cap:
1. running sequences that decode (one new token each), oldest first;
2. running sequences still prefilling (the next chunk of their prompt);
3. waiting sequences, first come first served: their prompt minus any
   prefix-cache hit, cut into a chunk that fits the remaining budget.
All of it rides in one ragged step. When only decodes can run (every
running sequence decodes, nothing waiting could be admitted, no sequence
needs the host between tokens: penalties), the step runs up to
`max_num_steps` decode steps in one device call, with pages reserved ahead.
With speculative decoding (a `proposer`, `jaxkv.core.spec_decode`) a
decoding sequence brings its last token plus up to `num_spec` proposals
(counted in the token budget, pages reserved for all of them), in any
step; a decode-only step with proposals runs as one verify step instead
of the multi-step loop. A step in which some sequence needs the host
between tokens (penalties, token rules) carries no proposals.

With overlapped scheduling the engine plans step N+1 while step N runs
(`schedule(lookahead=True)`): a sequence in step N counts the tokens N
will sample (`Sequence.ahead`) and the K/V it will write
(`inflight_end`), and decodes from there. Such a plan leaves out
sequences whose step N may be their last token, and never preempts:
where it would have to, it says so (`needs_preemption`, admitting no one
more) and the engine reads step N first, then plans again with
preemption.

When the page pool runs dry, the most recently admitted running sequence is
preempted by recompute: its pages are freed and it goes back to the front
of the queue (its prompt and the tokens generated so far are prefilled
again, mostly from the prefix cache).
"""

from __future__ import annotations

import collections
import dataclasses
import time

from jaxkv.core.block_manager import BlockManager, OutOfPages
from jaxkv.core.page_pool import salted_root
from jaxkv.core.sequence import Sequence, Status
from jaxkv.core.spec_decode import can_speculate


# Prompt rows per step of a request that wants prompt log-probabilities
# (their logits [rows, V] are computed at every row).
PROMPT_LOGPROB_CHUNK = 256


def _chunk_cap(seq: Sequence, start: int) -> int:
    if seq.params.prompt_logprobs is not None and start < len(seq.prompt_token_ids):
        return PROMPT_LOGPROB_CHUNK
    return 1 << 62


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # rows this step (with the proposals)
    block_table: list[int] = dataclasses.field(default_factory=list)  # after this step's growth
    num_spec: int = 0  # rows reserved for proposals (the proposer fills spec_tokens)
    spec_tokens: list[int] = dataclasses.field(default_factory=list)  # proposals, rows 1..k
    prev_row: int = -1  # >= 0: its one row's token comes from this row of the step before

    @property
    def known_end(self) -> int:
        """Position after the last known (not proposed) token of this chunk."""
        return self.start + self.num_tokens - len(self.spec_tokens)

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's last known token, so
        the step's sample is its next token."""
        return self.known_end == self.seq.num_tokens


def step_kind(scheduled) -> str:
    """"decode" when every sequence brings one known token, else "mixed"."""
    return "decode" if all(sc.known_end - sc.start == 1 for sc in scheduled) else "mixed"


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]  # copy-on-write page pairs to apply first
    preempted: list[Sequence]
    num_steps: int = 1  # decode steps in this call (> 1: every sequence decodes)
    needs_preemption: bool = False  # a lookahead plan that could not grow a sequence

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True,
                 max_num_steps: int = 1, proposer=None, num_spec: int = 0, gate=None):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.max_num_steps = max_num_steps
        self.proposer = proposer
        self.num_spec = num_spec
        self.propose_seconds = 0.0  # in the proposer's fill (a draft model's runs)
        self.gate = gate  # jaxkv.core.spec_decode.SpecGate: speculate where it pays
        self._gate_passed = False
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self._lookahead = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Run `children` beside their running parent, sharing its pages
        (copy-on-write of the partial last page when they grow)."""
        for c in children:
            self.bm.fork(parent.request_id, c.request_id)
            c.num_cached_tokens = parent.num_cached_tokens
            c.status = Status.RUNNING
            self.running.append(c)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free(seq.request_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def computed(self, seq: Sequence) -> int:
        """Tokens of a running sequence whose K/V is in the cache, or will
        be once the steps in flight ran."""
        return max(self.bm.num_computed_tokens(seq.request_id), seq.inflight_end)

    def schedule(self, lookahead: bool = False) -> SchedulerOutput:
        """The next step; with `lookahead`, planned while a step is in
        flight (no preemption, no sequence at its last token)."""
        self._lookahead = lookahead
        self._gate_passed = False
        n = self._decode_steps()
        out = self._schedule_decodes(n) if n > 1 else self._schedule_step()
        for sc in out.scheduled:
            sc.block_table = self.bm.block_table(sc.seq.request_id)
        drafting = [sc for sc in out.scheduled if sc.num_spec]
        # No proposals in a step the host re-samples, or where the gate
        # expects no gain (their reserved slots are trimmed after the step).
        if drafting and (not all(can_speculate(sc.seq) for sc in out.scheduled) or (
                not self._gate_passed and self.gate is not None
                and not self.gate.allow([(sc.seq, sc.num_spec) for sc in drafting],
                                        len(out.scheduled), step_kind(out.scheduled)))):
            for sc in drafting:
                sc.num_tokens -= sc.num_spec
                sc.num_spec = 0
            drafting = []
        if drafting:  # proposals once the pages are reserved (a draft writes there)
            t0 = time.perf_counter()
            self.proposer.fill(drafting)
            self.propose_seconds += time.perf_counter() - t0
        return out

    def _decode_only(self) -> bool:
        """Every running sequence decodes and nothing waiting could be
        admitted: a step of decodes only."""
        if not self.running or (self.waiting and len(self.running) < self.max_num_seqs):
            return False
        return len(self.running) <= self.max_num_batched_tokens and all(
            s.planned_tokens - self.computed(s) == 1 for s in self.running)

    def _proposals(self, seq: Sequence, budget: int) -> int:
        """Proposals a decoding sequence may bring within `budget` rows
        (its own row included)."""
        if self.proposer is None or not can_speculate(seq):
            return 0
        cap = min(self.num_spec, budget - 1, seq.tokens_left - 1)
        return self.proposer.max_proposals(seq, cap) if cap > 0 else 0

    def _decode_steps(self) -> int:
        """Decode steps the next call may run: more than one only when every
        running sequence decodes, nothing waiting could be admitted, and no
        sequence needs per-step host work (penalties, token rules)."""
        if self.max_num_steps <= 1 or not self._decode_only():
            return 1
        if not all(can_speculate(s) for s in self.running):
            return 1
        drafts = [(s, k) for s in self.running if (k := self._proposals(s, self.num_spec + 1))]
        if drafts and (self.gate is None or self.gate.allow(drafts, len(self.running), "decode")):
            self._gate_passed = True
            return 1  # a verify step instead
        return self.max_num_steps  # fixed: one program; the loop ends early

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.bm.free(victim.request_id)
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        out.scheduled = [s for s in out.scheduled if s.seq is not victim]

    def _grow(self, seq: Sequence, upto: int, out: SchedulerOutput) -> bool:
        """Make room for positions < upto, preempting the newest running
        sequences if needed. False if `seq` itself had to be preempted."""
        while True:
            need = upto - self.bm.num_tokens(seq.request_id)
            if need <= 0:
                return True
            try:
                out.copies.extend(self.bm.append_slots(seq.request_id, need))
                return True
            except OutOfPages:
                if self._lookahead:  # planned ahead: preempting waits for a plain plan
                    out.needs_preemption = True
                    return False
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    return False

    def _schedule_decodes(self, num_steps: int) -> SchedulerOutput:
        """Every running sequence decodes, with pages reserved for up to
        `num_steps` tokens (capped by what it may still generate); may
        preempt the newest."""
        out = SchedulerOutput([], [], [], num_steps=num_steps)
        for seq in list(self.running):
            if self._lookahead and seq.tokens_left <= 0:
                continue
            n = max(1, min(num_steps, seq.tokens_left))
            start = self.computed(seq) if seq in self.running else 0
            if seq in self.running and self._grow(seq, start + n, out):
                out.scheduled.append(ScheduledSeq(seq, start, 1))
        return out

    def _schedule_step(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.planned_tokens - self.computed(s) == 1
                   and not (self._lookahead and s.tokens_left <= 0)]
        prefills = [s for s in self.running if s.planned_tokens - self.computed(s) > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq not in self.running:  # preempted while making room for another
                continue
            start = self.computed(seq)
            k = self._proposals(seq, budget) if seq.planned_tokens - start == 1 else 0
            if k and not self.bm.can_append_slots(
                    seq.request_id, max(0, start + 1 + k - self.bm.num_tokens(seq.request_id))):
                k = 0  # proposals never preempt anyone
            n = min(seq.prefill_target - start, budget, _chunk_cap(seq, start)) + k
            if not self._grow(seq, start + n, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, start, n, num_spec=k))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs \
                and not out.preempted and not out.needs_preemption:
            seq = self.waiting[0]
            if seq.fork_pending and len(self.running) + seq.params.n > self.max_num_seqs:
                break  # its n sequences run together once it forks
            tokens = seq.all_token_ids[:seq.prefill_target]
            if not self.chunked and len(tokens) > budget:
                break
            try:  # a forking prompt's hits stop short of its target, so n >= 1
                cached = self.bm.allocate(seq.request_id, tokens, num_tokens=0,
                                          root=salted_root(seq.cache_salt),
                                          cache_hits=seq.params.prompt_logprobs is None)
            except OutOfPages:
                break
            n = min(len(tokens) - cached, budget, _chunk_cap(seq, cached))
            try:
                out.copies.extend(self.bm.append_slots(
                    seq.request_id, cached + n - self.bm.num_tokens(seq.request_id)))
            except OutOfPages:
                self.bm.free(seq.request_id)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, cached, n))
            budget -= n
        return out
