"""Seats of a hybrid KV pool: in a model whose layers differ in window
(Gemma's sliding and global layers), the sliding layers keep only each
running sequence's window, in a ring of `ring_pages` local pages that
belongs to the seat the sequence holds while it runs. Position p of a
sequence lives in local page ring_base + (p // page_size) % ring_pages
(`jaxkv.model.attention.local_view`); the global layers page as usual.

The scheduler takes a seat when a sequence starts running (admission, a
fork's child) and frees it when the sequence stops (finished, aborted,
preempted: it is recomputed on resume). A fork's children start from a
copy of the parent's ring, made before the next step."""

from __future__ import annotations


class Seats:
    """`max_num_seqs` seats of `ring_pages` pages each, the first at local
    page 1 (page 0 is the trash page). ring_pages 0: no hybrid pool, and
    every call does nothing."""

    def __init__(self, max_num_seqs: int, ring_pages: int):
        self.ring_pages = ring_pages
        self._free = list(range(max_num_seqs - 1, -1, -1)) if ring_pages else []
        self._copies: list[tuple[int, int]] = []

    def take(self, seq) -> None:
        """Give `seq` a seat: its `ring_base`."""
        if not self.ring_pages:
            return
        if not self._free:
            raise RuntimeError(f"hybrid KV pool: no free seat for sequence {seq.request_id!r}")
        seq.ring_base = 1 + self._free.pop() * self.ring_pages

    def free(self, seq) -> None:
        if seq.ring_base:
            self._free.append((seq.ring_base - 1) // self.ring_pages)
            seq.ring_base = 0

    def fork(self, parent, child) -> None:
        """Seat `child` with a copy of `parent`'s ring (queued for the next step)."""
        self.take(child)
        if self.ring_pages:
            self._copies += [(parent.ring_base + j, child.ring_base + j) for j in range(self.ring_pages)]

    def take_copies(self) -> list[tuple[int, int]]:
        """The ring copies queued since the last call (local page pairs)."""
        out, self._copies = self._copies, []
        return out
