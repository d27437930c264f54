"""Overlapped scheduling: plan and dispatch step N+1 before reading step N.

The engine's `step()` leaves the step it dispatched in flight (`InFlight`).
The next call plans the following step from what step N will have done
(`Scheduler.schedule(lookahead=True)`: each sequence's `ahead` tokens and
`inflight_end`), dispatches it, and only then reads step N's tokens, so
the host's reading, scheduling and packing run while the device computes.
A decoding sequence's input token in step N+1 is the token step N samples:
its row carries `prev_row`, its index in step N, and the step program takes
the token from the runner's `last` buffer on the device. A sequence that
finished in step N (stop token or string, max_tokens, abort) is skipped
when step N+1 is read: its extra token is discarded, and its pages were
freed when it finished (the device runs steps in dispatch order, so a
later owner's writes land after N+1's).

Steps are planned synchronously (read, then plan) while any unfinished
request needs the host between its tokens (penalties, token rules,
prompt log-probabilities, a pending n > 1 fork), with speculative
decoding, and where a lookahead plan would have to preempt.
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxkv.config import EngineConfig
from jaxkv.core.scheduler import SchedulerOutput
from jaxkv.core.spec_decode import can_speculate
from jaxkv.worker.execute import dispatch


@dataclasses.dataclass
class InFlight:
    """A dispatched step not read yet: its sequences, the runner's handle,
    rows with no allowed token, and the tokens each sequence gets."""

    sched: SchedulerOutput
    pending: object  # jaxkv.worker.runner.Pending
    stuck: list[int]
    ahead: list[int]


def overlap_default(config: EngineConfig) -> bool:
    """`async_scheduling` when unset: on where a device runs the steps
    (GPU, TPU), off on CPU, where the host and XLA share the cores."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    import jax
    return jax.default_backend() != "cpu"


class Overlap:
    """The engine's dispatch / read halves of a step (a mixin over its
    runner, scheduler, stats and `_accept`)."""

    def _overlaps(self) -> bool:
        """Whether the next step may be planned before this one is read:
        overlapped scheduling is on and no unfinished sequence needs the
        host between its tokens (penalties, token rules, prompt
        log-probabilities, a pending fork)."""
        return self.async_scheduling and all(
            can_speculate(s) and s.params.prompt_logprobs is None and not s.fork_pending
            for s in itertools.chain(self.scheduler.running, self.scheduler.waiting))

    def _dispatch(self, sched: SchedulerOutput, prev: InFlight | None) -> InFlight:
        """Enqueue `sched` on the device. A sequence of `prev` (in flight)
        decodes from the token `prev` samples, taken on the device."""
        self.runner.copy_pages(sched.copies)
        rows = {id(sc.seq): i for i, sc in enumerate(prev.sched.scheduled)} if prev else {}
        for sc in sched.scheduled:
            if sc.seq.ahead:
                sc.prev_row = rows[id(sc.seq)]
        pending, stuck = dispatch(self.runner, sched.scheduled, sched.num_steps,
                                  self.model_config.vocab_size)
        ahead = []
        for sc in sched.scheduled:
            s = sc.seq
            n = sched.num_steps if sc.known_end == s.planned_tokens else 0  # tokens it gets
            s.ahead += n
            s.inflight += 1
            s.inflight_end = sc.known_end + max(n - 1, 0)  # the newest token's K/V comes later
            ahead.append(n)
        return InFlight(sched, pending, stuck, ahead)

    def _resolve(self, fl: InFlight) -> list:
        """Read a step in flight and hand its tokens on."""
        res = self.runner.fetch(fl.pending)
        for sc, n in zip(fl.sched.scheduled, fl.ahead):
            s = sc.seq
            s.ahead -= n
            s.inflight -= 1
            if not s.inflight:
                s.inflight_end = 0
        touched: dict = {}
        self._accept(fl.sched.scheduled, res, fl.stuck, touched)
        self.stats["steps"] += 1
        return [self._output(p) for p in touched.values()]

