"""Continuous batching: what runs in the next step.

Every step, within a token budget and a sequence cap:
1. running sequences that decode (one new token each), oldest first;
2. running sequences still prefilling (the next chunk of their prompt);
3. waiting sequences, first come first served: their prompt minus any
   prefix-cache hit, cut into a chunk that fits the remaining budget.
All of it rides in one ragged step. When the page pool runs dry, the most
recently admitted running sequence is preempted by recompute: its pages are
freed and it goes back to the front of the queue (its prompt and the tokens
generated so far are prefilled again, mostly from the prefix cache).
"""

from __future__ import annotations

import collections
import dataclasses

from jaxkv.block_manager import BlockManager, OutOfPages
from jaxkv.sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # rows this step

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the sequence's last known token, so
        the step's sample is its next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    copies: list[tuple[int, int]]  # copy-on-write page pairs to apply first
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool = True):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free(seq.request_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.bm.free(victim.request_id)
        victim.status = Status.WAITING
        victim.num_computed = 0
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
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    return False

    def schedule_decode_burst(self, num_steps: int, tokens_left: dict) -> SchedulerOutput:
        """Every running sequence decodes, with pages reserved for up to
        `num_steps` tokens (multi-step decode; `tokens_left[request_id]` caps
        it); may preempt the newest."""
        out = SchedulerOutput([], [], [])
        for seq in list(self.running):
            n = min(num_steps, tokens_left[seq.request_id])
            if seq in self.running and self._grow(seq, seq.num_computed + n, out):
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed, 1))
        return out

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.max_num_batched_tokens
        decodes = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq not in self.running:  # preempted while making room for another
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self._grow(seq, seq.num_computed + n, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs \
                and not out.preempted:
            seq = self.waiting[0]
            tokens = seq.all_token_ids
            if not self.chunked and len(tokens) > budget:
                break
            try:
                cached = self.bm.allocate(seq.request_id, tokens, num_tokens=0)
            except OutOfPages:
                break
            n = min(len(tokens) - cached, budget)
            try:
                out.copies.extend(self.bm.append_slots(
                    seq.request_id, cached + n - self.bm.num_tokens(seq.request_id)))
            except OutOfPages:
                self.bm.free(seq.request_id)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.num_computed = cached
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, cached, n))
            budget -= n
        return out
