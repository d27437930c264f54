"""The padded shapes an engine runs and the keys of its step programs.

T tokens and S sequences per step pad up to a bucket, so a step compiles
once per `ProgramKey` (kind, T, S) and never again; `Buckets.programs` lists
every key an engine can reach, which is what warm-up compiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple


class ProgramKey(NamedTuple):
    """Which compiled step program runs a batch, and its padded token and
    sequence counts. kind "decode" (T == S): decode steps only, up to K per
    call; "mixed" (T > S): one step with prefill chunks; "both" (T == S):
    either, the attention path picked at run time (a T == S shape that is
    also a mixed bucket, compiled once for both uses); "verify": one step
    with logits at k + 1 rows per sequence, speculative verification (a
    decoding sequence brings its last token plus up to k proposals)."""

    kind: str
    tokens: int
    seqs: int

    @property
    def loops(self) -> bool:
        """Whether the program may run several decode steps per call."""
        return self.kind in ("decode", "both")


def _pow2_buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    out.append(hi)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The padded shapes an engine runs, small enough to compile them all.

    decode_seqs: S of decode programs (powers of two up to the most
    sequences a step can hold). mixed: (T, S) of mixed programs: T powers
    of two from 16 up to the token budget; S = T's most sequences, and from
    T = 64 on also 1 and 8, since padded sequences cost rows of the head and
    the sampler and smaller query blocks in the reference attention
    (measured: a 256-token prompt alone takes 779 ms padded to 8 sequences,
    629 ms at 1). pages_per_seq: W. history: N of the penalty sampler
    (powers of four from 8192 up to the longest sequence). A T == S shape
    in both lists is one program ("both"). num_spec: k of speculative
    decoding (0: off); then `verify_shapes` lists the verify programs."""

    decode_seqs: tuple[int, ...]
    mixed: tuple[tuple[int, int], ...]
    pages_per_seq: int
    history: tuple[int, ...]
    num_spec: int = 0

    @classmethod
    def make(
        cls,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        pages_per_seq: int,
        max_model_len: int,
        num_spec: int = 0,
    ) -> Buckets:
        max_s = min(max_num_seqs, max_num_batched_tokens)
        mixed = []
        for t in _pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens):
            # From T = 64 on also one sequence (a lone prompt: the reference
            # attention sizes its query blocks by T / S) and a few (8).
            counts = {1, min(8, max_s), min(max_s, t)} if t >= 64 else {min(max_s, t)}
            mixed += [(t, s) for s in sorted(counts)]
        return cls(
            decode_seqs=_pow2_buckets(1, max_s),
            mixed=tuple(mixed),
            pages_per_seq=pages_per_seq,
            history=_pow2_buckets(min(8192, max_model_len), max_model_len, factor=4),
            num_spec=num_spec,
        )

    def _key(self, t: int, s: int) -> ProgramKey:
        if t == s and s in self.decode_seqs:
            return ProgramKey("both" if (t, s) in self.mixed else "decode", t, s)
        return ProgramKey("mixed", t, s)

    def key_for(self, num_rows: int, num_seqs: int, all_decode: bool, verifies: bool) -> ProgramKey:
        """The program of a step of `num_rows` rows of `num_seqs` sequences:
        a verify program when some sequence brings proposals, a decode
        program when every sequence brings one row, else a mixed one."""
        if verifies:
            return self.verify_key(num_rows, num_seqs)
        if all_decode:
            return self.decode_key(num_seqs)
        return self.mixed_key(num_rows, num_seqs)

    def decode_key(self, num_seqs: int) -> ProgramKey:
        s = _pick(self.decode_seqs, num_seqs, "sequences per step")
        return self._key(s, s)

    def verify_shapes(self) -> list[tuple[int, int]]:
        """(T, S) of verify programs: S (k + 1) rows for every decode S (all
        sequences drafting), and every mixed shape (prefill chunks beside
        drafting decodes); none when speculation is off."""
        if not self.num_spec:
            return []
        K1 = self.num_spec + 1
        return sorted({(s * K1, s) for s in self.decode_seqs} | set(self.mixed))

    def verify_key(self, num_tokens: int, num_seqs: int) -> ProgramKey:
        """The cheapest verify program that holds the step: fewest rows plus
        logits rows (S (k + 1))."""
        fits = [(t, s) for t, s in self.verify_shapes() if t >= num_tokens and s >= num_seqs]
        if not fits:
            raise ValueError(
                f"tokens per step: {num_tokens} tokens of {num_seqs} sequences fit "
                f"no verify program (speculation {'on' if self.num_spec else 'off'})"
            )
        t, s = min(fits, key=lambda ts: ts[0] + ts[1] * (self.num_spec + 1))
        return ProgramKey("verify", t, s)

    def mixed_key(self, num_tokens: int, num_seqs: int) -> ProgramKey:
        for t, s in self.mixed:
            if num_tokens <= t and num_seqs <= s:
                return self._key(t, s)
        raise ValueError(
            f"tokens per step: {num_tokens} tokens of {num_seqs} sequences exceed "
            f"the largest bucket {self.mixed[-1]}"
        )

    def history_width(self, n: int) -> int:
        return _pick(self.history, n, "penalty history")

    def programs(self) -> list[ProgramKey]:
        """Every step program an engine with these buckets can run."""
        keys = [self._key(s, s) for s in self.decode_seqs]
        keys += [self._key(t, s) for t, s in self.mixed]
        keys += [ProgramKey("verify", t, s) for t, s in self.verify_shapes()]
        return list(dict.fromkeys(keys))


def _pick(buckets: Sequence[int], n: int, what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what}: {n} exceeds the largest bucket {buckets[-1]}")
