"""Speculative decoding, the host side: who proposes, and what it earned.

A decoding sequence brings its last token plus up to k proposed tokens to
one step (q_len 1 + k); the step returns the target's sample at each of
those rows and accepts on the device the longest prefix of proposals that
equals the target's own draws, plus the draw after it
(`jaxkv.worker.verify.verify_step`). Proposals here are deterministic (a
point mass), for which that rule *is* the rejection-sampling rule: a
proposal x is accepted with probability p(x), and on rejection the token
comes from p with x removed. So outputs are exactly the target's, and for a
seeded request the very tokens it gets without speculation.

Proposers (`jaxkv.core.spec.draft_model.make_proposer`): `NgramProposer` (prompt lookup, on the host)
and `jaxkv.core.spec.draft_model.DraftProposer` (a small model run k steps ahead on
the device). `SpecControl` is speculation's one control object, which the
scheduler and the engine are given: it asks the proposer
(`max_proposals(seq, cap)` while a step is planned, `fill(scheduled)` once
pages are reserved), decides through the gate whether a step speculates,
times the proposing, and learns from each step run (costs, acceptance).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from jaxkv.config import SpeculativeConfig

log = logging.getLogger("jaxkv")


def can_speculate(seq) -> bool:
    """Sequences whose next token is drawn on the device from the step's own
    logits: not those with penalties or token rules (structured outputs,
    logit bias, bad words), which the host re-draws one token at a time."""
    return not seq.params.uses_penalties and seq.rules is None


def ngram_lookup(tokens: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: for n from n_max down to n_min, find the latest earlier
    place where the last n tokens occur and propose the (up to k) tokens that
    followed it; [] when no n matches. tokens [N] int."""
    N = len(tokens)
    for n in range(min(n_max, N - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[: N - 1], n)  # starts 0 .. N-1-n, each followed
        hits = np.flatnonzero((windows == tokens[N - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    """n-gram (prompt lookup) proposals from the sequence's own prompt and
    output; a sequence without a match decodes normally that step."""

    def __init__(self, cfg: SpeculativeConfig):
        self.k = cfg.num_speculative_tokens
        self.n_max = cfg.prompt_lookup_max
        self.n_min = cfg.prompt_lookup_min
        # The lookup of a planning pass, kept for its fill: id -> (seq, length, proposals).
        self._memo: dict[int, tuple[object, int, list[int]]] = {}

    def _propose(self, seq) -> list[int]:
        n = seq.num_tokens
        hit = self._memo.get(id(seq))
        if hit is None or hit[0] is not seq or hit[1] != n:
            if len(self._memo) > 4096:
                self._memo.clear()
            hit = self._memo[id(seq)] = (
                seq,
                n,
                ngram_lookup(seq.all_token_ids, self.k, self.n_max, self.n_min),
            )
        return hit[2]

    def max_proposals(self, seq, cap: int) -> int:
        return min(len(self._propose(seq)), cap)

    def fill(self, scheduled) -> None:
        """Set each drafting ScheduledSeq's proposals (at most its num_spec
        reserved rows)."""
        for sc in scheduled:
            sc.spec_tokens = self._propose(sc.seq)[: sc.num_spec]
            sc.num_rows += len(sc.spec_tokens) - sc.num_spec
        self._memo.clear()


def step_kind(scheduled) -> str:
    """ "decode" when every sequence brings one known token, else "mixed"."""
    return "decode" if all(sc.known_end - sc.start == 1 for sc in scheduled) else "mixed"


class SpecControl:
    """Speculation's control: the proposer, the gate (None: speculate
    whenever there are proposals), the seconds spent proposing, and the
    figures learned. `num_programs()` counts the programs compiled so far
    (the draft's too): a step during which one compiled teaches no cost."""

    def __init__(self, proposer, num_spec: int, adaptive: bool, num_programs: Callable[[], int]):
        self.proposer = proposer
        self.num_spec = num_spec
        self.gate = SpecGate() if adaptive else None
        self.stats = SpecStats()
        self.propose_seconds = 0.0
        self._num_programs = num_programs
        self._step_seconds = 0.0  # proposing in the step being planned
        self._programs = 0

    def begin_plan(self) -> None:
        """A step is being planned: its proposing time starts at zero."""
        self._step_seconds = 0.0
        self._programs = self._num_programs()

    def max_proposals(self, seq, cap: int) -> int:
        if not can_speculate(seq):
            return 0
        cap = min(self.num_spec, cap, seq.tokens_left - 1)
        return self.proposer.max_proposals(seq, cap) if cap > 0 else 0

    def allow(self, drafts, num_seqs: int, kind: str) -> bool:
        return self.gate is None or self.gate.allow(drafts, num_seqs, kind)

    def fill(self, drafting) -> None:
        """Proposals into each drafting ScheduledSeq (timed)."""
        t0 = time.perf_counter()
        self.proposer.fill(drafting)
        dt = time.perf_counter() - t0
        self.propose_seconds += dt
        self._step_seconds += dt

    def metrics(self, step_seconds: float) -> dict:
        """The figures so far, with the seconds spent proposing and their
        share of `step_seconds`."""
        d = self.stats.as_dict()
        d["propose_seconds"] = self.propose_seconds
        d["propose_share"] = self.propose_seconds / step_seconds if step_seconds else 0.0
        return d

    def after_step(self, scheduled, res, seconds: float) -> tuple[int, int] | None:
        """A step of `scheduled` ran in `seconds` (wall, device included)
        and gave `res`: count its proposals and acceptances and teach the
        gate. Returns (proposed, accepted), or None when it verified
        nothing."""
        counted = self.stats.record(scheduled, res)
        if counted is not None and self.stats.steps % 100 == 0:
            log.info("jaxkv: speculative decoding: %s", self.stats.as_dict())
        if self.gate is not None:
            seconds += self._step_seconds
            if self._num_programs() != self._programs:  # a compile ran inside: no cost figure
                seconds = float("nan")
            self.gate.observe(
                step_kind(scheduled),
                counted is not None,
                len(scheduled),
                seconds,
                len(res.tokens) if counted is None else 1,
                *(counted or ()),
            )
        return counted


class SpecGate:
    """Speculate in a step only where it is expected to pay. Verifying k
    proposals costs more than a plain step by a factor that depends on the
    hardware (near 1 on an accelerator, 2x or more for a few rows on a
    CPU, whose small matrix products run far below their one-row speed),
    so the gate measures it: the wall time per model call of plain and of
    speculating steps, kept per kind (decode-only or with prefill) and
    sequence bucket, and each sequence's acceptance rate (shrunk toward the
    engine's). A step speculates when its expected tokens per second beat
    plain decoding's; every `probe_every` refusals it speculates anyway, so
    costs and acceptance stay current (a sequence may start copying). In a
    bucket not measured yet it speculates once, then runs plain once (a
    proposer with proposals for every sequence would otherwise never let
    plain decoding be measured)."""

    def __init__(self, probe_every: int = 8, smoothing: float = 0.2):
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.seconds: dict[tuple[str, bool, int], float] = {}  # ("decode", spec, S) -> per call
        self.alpha = 0.5  # the engine's acceptance rate per proposal
        self.refused = 0

    @staticmethod
    def _key(kind: str, spec: bool, num_seqs: int) -> tuple[str, bool, int]:
        return kind, spec, 1 << max(num_seqs - 1, 0).bit_length()

    def expected_accepted(self, seq, k: int) -> float:
        """Expected accepted proposals of k, each accepted with the
        sequence's rate given all before it were."""
        a = (seq.spec_accepted + 4 * self.alpha) / (seq.spec_proposed + 4)
        return sum(a**j for j in range(1, k + 1))

    def allow(self, drafts, num_seqs: int, kind: str) -> bool:
        """drafts: (sequence, k) of the step's drafting sequences. A step
        with prefill chunks ("mixed") decides from the decode-only costs of
        its sequence bucket (its chunks cost the same either way, and its
        own cost varies with them) and does not speculate before those are
        measured."""
        plain = self.seconds.get(self._key("decode", False, num_seqs))
        spec = self.seconds.get(self._key("decode", True, num_seqs))
        if kind == "mixed" and (plain is None or spec is None):
            return False
        if plain is None or spec is None:  # measure both: a speculating step, then a plain one
            self.refused = 0
            return spec is None
        if self.refused >= self.probe_every:
            self.refused = 0
            return True
        gain = num_seqs + sum(self.expected_accepted(s, k) for s, k in drafts)
        if gain / spec > num_seqs / plain:
            return True
        self.refused += 1
        return False

    def observe(
        self,
        kind: str,
        spec: bool,
        num_seqs: int,
        seconds: float,
        calls: int,
        proposed: int = 0,
        accepted: int = 0,
    ) -> None:
        """A step ran: its wall time (with proposing) and model calls. Only
        decode-only steps teach costs (`allow` reads no other), and not one
        that compiled (NaN seconds)."""
        key, w = self._key(kind, spec, num_seqs), self.smoothing
        per_call = seconds / max(calls, 1)
        old = self.seconds.get(key)
        if kind == "decode" and per_call == per_call:
            self.seconds[key] = per_call if old is None else (1 - w) * old + w * per_call
        if proposed:
            self.alpha = (1 - w) * self.alpha + w * accepted / proposed


@dataclasses.dataclass
class SpecStats:
    """Aggregate figures: steps that verified proposals, sequences in them
    that brought some (drafts), proposed and accepted tokens."""

    steps: int = 0
    drafts: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting sequence gained per step: accepted + the target's own."""
        return 1 + self.accepted / self.drafts if self.drafts else 0.0

    def record(self, scheduled, res) -> tuple[int, int] | None:
        """Count a step's proposals and acceptances (per sequence too):
        (proposed, accepted), or None when the step verified nothing."""
        drafts = [(i, sc) for i, sc in enumerate(scheduled) if sc.spec_tokens]
        if not drafts:
            return None
        self.steps += 1
        proposed = accepted = 0
        for i, sc in drafts:
            k, a = len(sc.spec_tokens), int(res.counts[i]) - 1
            proposed, accepted = proposed + k, accepted + a
            sc.seq.spec_proposed += k
            sc.seq.spec_accepted += a
        self.drafts += len(drafts)
        self.proposed += proposed
        self.accepted += accepted
        return proposed, accepted

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length
        )
        return d
