"""Overlapped scheduling: plan and dispatch step N+1 before reading step N.

The engine's `step()` leaves the step it dispatched in flight (`InFlight`,
held here). The next call plans the following step from what step N will
have done (`Scheduler.schedule(lookahead=True)`: each sequence's progress
counts the tokens N samples and the K/V it writes), dispatches it, and
only then reads step N's tokens, so the host's reading, scheduling and
packing run while the device computes. A decoding sequence's input token
in step N+1 is the token step N samples: its row carries `prev_row`, its
index in step N, and the step program takes the token from the runner's
`last` buffer on the device. A sequence that finished in step N (stop
token or string, max_tokens, abort) is skipped when step N+1 is read: its
extra token is discarded, and its pages were freed when it finished (the
device runs steps in dispatch order, so a later owner's writes land after
N+1's).

Steps are planned synchronously (read, then plan) while any unfinished
request needs the host between its tokens (penalties, token rules,
prompt log-probabilities, a pending n > 1 fork), with speculative
decoding, and where a lookahead plan would have to preempt.
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxkv.config import EngineConfig
from jaxkv.core.scheduling.scheduler import Scheduler
from jaxkv.core.scheduling.scheduler_output import SchedulerOutput
from jaxkv.core.spec.decode import can_speculate


@dataclasses.dataclass
class InFlight:
    """A dispatched step not read yet: its plan, the runner's handle, and
    its sequences whose rules allowed no token."""

    sched: SchedulerOutput
    pending: object  # jaxkv.worker.runner.Pending
    stuck: list[int]


def overlap_default(config: EngineConfig) -> bool:
    """`async_scheduling` when unset: on where a device runs the steps
    (GPU, TPU), off on CPU, where the host and XLA share the cores."""
    if config.async_scheduling is not None:
        return config.async_scheduling
    import jax

    return jax.default_backend() != "cpu"


class Overlap:
    """The step in flight and how steps are put in flight (`dispatch`) and
    read back (`read`), over the engine's executor and scheduler."""

    def __init__(self, executor, scheduler: Scheduler, enabled: bool):
        self.executor = executor
        self.scheduler = scheduler
        self.enabled = enabled
        self.inflight: InFlight | None = None

    def allowed(self) -> bool:
        """Whether the next step may be planned before this one is read:
        overlapped scheduling is on and no unfinished sequence needs the
        host between its tokens (penalties, token rules, prompt
        log-probabilities, a pending fork)."""
        sched = self.scheduler
        return self.enabled and all(
            can_speculate(s) and s.params.prompt_logprobs is None and not s.fork_pending
            for s in itertools.chain(sched.running, sched.waiting)
        )

    def dispatch(self, sched: SchedulerOutput, prev: InFlight | None) -> InFlight:
        """Enqueue `sched` on the device. A sequence of `prev` (in flight)
        decodes from the token `prev` samples, taken on the device."""
        self.executor.apply_copies(sched)
        if prev is not None:
            rows = {id(sc.seq): i for i, sc in enumerate(prev.sched.scheduled)}
            for sc in sched.scheduled:
                if sc.seq.inflight_tokens:
                    sc.prev_row = rows[id(sc.seq)]
        pending, stuck = self.executor.dispatch(sched.scheduled, sched.num_steps)
        self.scheduler.dispatched(sched)
        return InFlight(sched, pending, stuck)

    def read(self, fl: InFlight):
        """Wait for a step in flight; its StepResult."""
        res = self.executor.runner.fetch(fl.pending)
        self.scheduler.read(fl.sched)
        return res
