"""Continuous batching: what runs in the next step.

Every step, within a token budget and a sequence cap:
1. running sequences that decode (one new token each), oldest first;
2. running sequences still prefilling (the next chunk of their prompt);
3. waiting sequences, first come first served: their prompt minus any
   prefix-cache hit, cut into a chunk that fits the remaining budget.
All of it rides in one ragged step. When only decodes can run (every running sequence decodes,
nothing waiting could be admitted, no sequence needs the host between tokens: penalties), the
step runs up to `max_num_steps` decode steps in one device call, with pages reserved ahead.
With speculative decoding (a `proposer`, `jaxkv.core.spec.decode`) a decoding sequence brings
its last token plus up to `num_spec` proposals (counted in the token budget, pages reserved for
all of them), in any step; a decode-only step with proposals runs as one verify step instead of
the multi-step loop. A step where some sequence needs the host between tokens (penalties, token
rules) carries no proposals.

With overlapped scheduling the engine plans step N+1 while step N runs (`schedule(lookahead=
True)`): a sequence in step N counts the tokens N will sample and the K/V it will write (its
`Progress`: `inflight_tokens`, `inflight_end`), and decodes from there. Such a plan leaves out
sequences whose step N may be their last token, and never preempts: where it would have to, it
says so (`needs_preemption`, admitting no one more) and the engine reads step N first, then
plans again with preemption.

When the page pool runs dry, the most recently admitted running sequence is preempted: its pages
are freed and it goes back to the front of the queue (what it computed comes back from the prefix
cache or the host tier, else is prefilled again). A request with n > 1 holds n seats from its
admission on; one with a LoRA adapter waits for a device slot while those after it may start.

Each running sequence's `jaxkv.core.progress.Progress` is this scheduler's record: it reserves
and trims slots through the block manager as it plans (`schedule`), counts what a dispatched
step adds (`dispatched`), and takes back what a step read did (`read`, `chunk_ran`,
`tokens_taken`). A hybrid KV pool's rings are its `seats` (`jaxkv.core.scheduling.seats`)."""

from __future__ import annotations

import collections

from jaxkv.core.scheduling.block_manager import BlockManager, OutOfPages
from jaxkv.core.scheduling.page_pool import salted_root
from jaxkv.core.scheduling.scheduler_output import ScheduledSeq, SchedulerOutput, chunk_cap
from jaxkv.core.scheduling.seats import Seats
from jaxkv.core.sequence import Sequence, Status
from jaxkv.core.spec.decode import SpecControl, can_speculate, step_kind


class Scheduler:
    """`spec`: speculation's control (`SpecControl`, None: off). `window` / `num_sink_tokens`:
    the attention window; pages wholly behind it (past the sinks) are released as a sequence
    advances. `seats`: a hybrid pool's (None: none). `loras`: the LoRA slots (None: off)."""

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        max_num_steps: int = 1,
        spec: SpecControl | None = None,
        window: int | None = None,
        num_sink_tokens: int = 0,
        seats: Seats | None = None,
        loras=None,
    ):
        self.bm = block_manager
        self.loras = loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked = enable_chunked_prefill
        self.max_num_steps = max_num_steps
        self.spec = spec
        self.window = window
        self.num_sink_tokens = num_sink_tokens
        self._gate_passed = False
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self._lookahead = False
        self.seats = seats or Seats(max_num_seqs, 0)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Run `children` beside their running parent, sharing its pages
        (copy-on-write of the partial last page when they grow)."""
        for c in children:
            self.bm.fork(parent.request_id, c.request_id)
            c.progress = self.bm.progress(c.request_id)
            c.num_cached_tokens = parent.num_cached_tokens
            c.status = Status.RUNNING
            self.seats.fork(parent, c)
            self.running.append(c)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free(seq.request_id)
            self.seats.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def dispatched(self, out: SchedulerOutput) -> None:
        """`out` was dispatched and is in flight: count the tokens it
        samples for each sequence and the K/V it writes."""
        for sc in out.scheduled:
            s, p = sc.seq, sc.seq.progress
            n = out.num_steps if sc.known_end == s.planned_tokens else 0
            sc.inflight_tokens = n
            p.inflight_tokens += n
            p.inflight_steps += 1
            p.inflight_end = sc.known_end + max(n - 1, 0)  # the newest token's K/V comes later

    def read(self, out: SchedulerOutput) -> None:
        """A dispatched `out` was read: its tokens are on the host now."""
        for sc in out.scheduled:
            p = sc.seq.progress
            p.inflight_tokens -= sc.inflight_tokens
            p.inflight_steps -= 1
            if not p.inflight_steps:
                p.inflight_end = 0

    def chunk_ran(self, sc: ScheduledSeq) -> bool:
        """A step ran `sc`'s rows (before its tokens are taken): their K/V is
        written. True when `sc` was the last chunk before a pending fork."""
        s = sc.seq
        if sc.completes:
            self._computed(s, sc.known_end)
            return False
        end = sc.start + sc.num_rows
        self._computed(s, end)
        return s.fork_pending and end == s.prefill_target

    def tokens_taken(self, sc: ScheduledSeq, count: int) -> None:
        """`count` sampled tokens of `sc`'s sequence were taken (it may have
        finished): every one but the newest has its K/V written, and slots
        reserved past the planned tokens (rejected proposals, decode steps
        not run) go back."""
        s = sc.seq
        if s.finished:
            self.remove(s)
            return
        if count > 1:
            self._computed(s, s.num_tokens - 1)
        self.bm.trim(s.request_id, s.planned_tokens)

    def _computed(self, s: Sequence, num_computed: int) -> None:
        """Record K/V written up to num_computed (new full pages named in the prefix cache
        and ring); free pages behind the window."""
        first = len(s.progress.hashes)
        self.bm.mark_computed(s.request_id, s.all_token_ids, num_computed)
        self.seats.label(s, first)
        if self.window is not None:  # the next query sits at num_computed
            self.bm.release_range(
                s.request_id, self.num_sink_tokens, num_computed - self.window + 1
            )

    def schedule(self, lookahead: bool = False) -> SchedulerOutput:
        """The next step; with `lookahead`, planned while a step is in
        flight (no preemption, no sequence at its last token)."""
        self._lookahead = lookahead
        self._gate_passed = False
        if (spec := self.spec) is not None:
            spec.begin_plan()
        n = self._decode_steps()
        out = self._schedule_decodes(n) if n > 1 else self._schedule_step()
        drafting = [sc for sc in out.scheduled if sc.num_spec]
        # No proposals in a step the host re-samples, or where the gate
        # expects no gain (their reserved slots are trimmed after the step).
        if drafting and (
            not all(can_speculate(sc.seq) for sc in out.scheduled)
            or (
                not self._gate_passed
                and not spec.allow(
                    [(sc.seq, sc.num_spec) for sc in drafting],
                    len(out.scheduled),
                    step_kind(out.scheduled),
                )
            )
        ):
            for sc in drafting:
                sc.num_rows -= sc.num_spec
                sc.num_spec = 0
            drafting = []
        if drafting:  # proposals once the pages are reserved (a draft writes there)
            spec.fill(drafting)
        for sc in out.scheduled:  # ring pages this step writes lose their labels
            self.seats.written(sc.seq, sc.start, sc.seq.progress.num_reserved)
        if out.scheduled or out.needs_preemption:  # else the engine applies no copies: kept
            out.local_copies = self.seats.take_copies()
            out.transfers = self.bm.take_transfers()
        return out

    def _decode_only(self) -> bool:
        """Every running sequence decodes and nothing waiting could be
        admitted: a step of decodes only."""
        if not self.running or (self.waiting and self._seats() < self.max_num_seqs):
            return False
        return len(self.running) <= self.max_num_batched_tokens and all(
            s.planned_tokens - s.progress.num_scheduled == 1 for s in self.running
        )

    def _seats(self) -> int:
        """Sequences running, counting the siblings a pending fork adds."""
        return len(self.running) + sum(s.params.n - 1 for s in self.running if s.fork_pending)

    def _proposals(self, seq: Sequence, budget: int) -> int:
        """Proposals a decoding sequence may bring within `budget` rows (its own included)."""
        return 0 if self.spec is None else self.spec.max_proposals(seq, budget - 1)

    def _decode_steps(self) -> int:
        """Decode steps the next call may run: more than one only when every
        running sequence decodes, nothing waiting could be admitted, and no
        sequence needs per-step host work (penalties, token rules)."""
        if self.max_num_steps <= 1 or not self._decode_only():
            return 1
        if not all(can_speculate(s) for s in self.running):
            return 1
        if self.spec is not None:
            k = self.spec.num_spec
            drafts = [(s, n) for s in self.running if (n := self._proposals(s, k + 1))]
            if drafts and self.spec.allow(drafts, len(self.running), "decode"):
                self._gate_passed = True
                return 1  # a verify step instead
        return self.max_num_steps  # fixed: one program; the loop ends early

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.bm.free(victim.request_id)
        self.seats.free(victim)
        victim.progress = None
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        out.scheduled = [s for s in out.scheduled if s.seq is not victim]

    def _grow(self, seq: Sequence, upto: int, out: SchedulerOutput) -> bool:
        """Room for positions < upto, preempting the newest if needed (False: `seq` itself)."""
        while True:
            need = upto - seq.progress.num_reserved
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
        """Every running sequence decodes, pages reserved for up to `num_steps`
        tokens (capped by what it may still generate); may preempt the newest."""
        out = SchedulerOutput([], [], [], num_steps=num_steps)
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted making room for another
                continue
            if self._lookahead and seq.tokens_left <= 0:
                continue
            n = max(1, min(num_steps, seq.tokens_left))
            start = seq.progress.num_scheduled
            if self._grow(seq, start + n, out):
                out.scheduled.append(ScheduledSeq(seq, start, 1))
        return out

    def _schedule_step(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.max_num_batched_tokens
        decodes, prefills = [], []
        for s in self.running:
            left = s.planned_tokens - s.progress.num_scheduled
            if left == 1:
                if not (self._lookahead and s.tokens_left <= 0):
                    decodes.append(s)
            elif left > 1:
                prefills.append(s)
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted making room for another
                continue
            p, start = seq.progress, seq.progress.num_scheduled
            decodes_one = seq.planned_tokens - start == 1
            k = self._proposals(seq, budget) if decodes_one else 0
            if k and not self.bm.can_append_slots(
                seq.request_id, max(0, start + 1 + k - p.num_reserved)
            ):
                k = 0  # proposals never preempt anyone
            if decodes_one and not seq.fork_pending:  # a decode row
                n = 1 + k
            else:
                n = min(seq.prefill_target - start, budget, chunk_cap(seq, start)) + k
            if not self._grow(seq, start + n, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, start, n, num_spec=k))
            budget -= n
        seats, skipped = self._seats(), []  # skipped: waiting for a LoRA slot
        while (
            self.waiting
            and budget > 0
            and seats < self.max_num_seqs
            and not out.preempted
            and not out.needs_preemption
        ):
            seq = self.waiting[0]
            if seq.fork_pending and seats + seq.params.n > self.max_num_seqs:
                break  # its n sequences run together once it forks
            target = seq.prefill_target
            if not self.chunked and target > budget:
                break
            if self.loras is not None and not self.loras.admit(seq, self.running):
                skipped.append(self.waiting.popleft())  # every slot is read: the next may run
                continue
            tokens, adapter = seq.all_token_ids[:target], seq.lora and seq.lora.key
            try:  # a forking prompt's hits stop short of its target, so n >= 1
                cached = self.bm.allocate(
                    seq.request_id,
                    tokens,
                    num_reserved=0,
                    root=salted_root(seq.cache_salt, adapter),
                    cache_hits=seq.params.prompt_logprobs is None,
                    hit_cap=self.seats.hit_cap if self.seats.ring_pages else None,
                )
            except OutOfPages:
                break
            n = min(target - cached, budget, chunk_cap(seq, cached))
            p = self.bm.progress(seq.request_id)
            try:
                out.copies.extend(self.bm.append_slots(seq.request_id, cached + n - p.num_reserved))
            except OutOfPages:
                self.bm.free(seq.request_id)
                break
            self.waiting.popleft()
            seq.progress, seq.status = p, Status.RUNNING
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = cached
            self.seats.take(seq, p.hashes)  # the hit's pages, for the sliding layers' window
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, cached, n))
            budget -= n
            seats += seq.params.n if seq.fork_pending else 1
        self.waiting.extendleft(reversed(skipped))  # their places in the queue kept
        return out
