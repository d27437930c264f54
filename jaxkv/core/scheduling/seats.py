"""Seats of a hybrid KV pool: in a model whose layers differ in window
(Gemma's sliding and global layers), the sliding layers keep only each
running sequence's window, in a ring of `ring_pages` local pages that
belongs to the seat the sequence holds while it runs. Position p of a
sequence lives in local page ring_base + (p // page_size) % ring_pages
(`jaxkv.model.attention.local_view`); the global layers page as usual.

The scheduler takes a seat when a sequence starts running (admission, a
fork's child) and frees it when the sequence stops (finished, aborted,
preempted). A fork's children start from a copy of the parent's ring,
made before the next step.

Prefix-cache hits. A hit of k full pages needs, beside the global layers'
pages, the sliding layers' K/V of the window before position k * page_size.
Every ring page that holds a full computed page of a sequence is labelled
with that page's chain hash (the prefix cache's, cache salt included)
until a write lands on it, in a running seat or a free one (a freed seat's
ring keeps what its last sequence wrote until a new one writes there).
The scheduler caps a hit (`hit_cap`) to the longest prefix whose window
pages are all labelled somewhere, and `take` seats the sequence in the free
seat that already holds most of them in place, copying the rest from where
they are (queued with the step's copies, which run before it: a page a
step overwrites is read first). A long-finished prompt's window may be
gone; the hit is then shorter, never wrong."""

from __future__ import annotations


class Seats:
    """`max_num_seqs` seats of `ring_pages` pages each, the first at local
    page 1 (page 0 is the trash page); `page_size` and the sliding layers'
    `window` place hits. ring_pages 0: no hybrid pool, and every call does
    nothing."""

    def __init__(self, max_num_seqs: int, ring_pages: int, page_size: int = 1, window: int = 0):
        self.ring_pages = ring_pages
        self.page_size = page_size
        self.window = window
        self._free = list(range(max_num_seqs)) if ring_pages else []  # longest free first
        self._copies: list[tuple[int, int]] = []
        self._label: dict[int, tuple[int, bytes]] = {}  # local page -> (page index, chain hash)
        self._where: dict[bytes, int] = {}  # chain hash -> a local page holding it
        self._count = [0] * max_num_seqs  # labelled pages per seat
        self.pages_in_place = 0  # hit pages found where the sequence needs them
        self.pages_copied = 0  # hit pages copied from another ring

    # ----------------------------------------------------------- labels
    def _seat(self, page: int) -> int:
        return (page - 1) // self.ring_pages

    def _drop(self, page: int) -> None:
        lab = self._label.pop(page, None)
        if lab is not None:
            self._count[self._seat(page)] -= 1
            if self._where.get(lab[1]) == page:
                del self._where[lab[1]]

    def _set(self, page: int, j: int, h: bytes) -> None:
        self._drop(page)
        self._label[page] = (j, h)
        self._where[h] = page
        self._count[self._seat(page)] += 1

    def _window_start(self, k: int) -> int:
        """The first page a query at position k * page_size reads in a sliding layer."""
        return max(0, k * self.page_size - self.window + 1) // self.page_size

    def hit_cap(self, hashes: list[bytes]) -> int:
        """Of a prefix hit whose pages have chain hashes `hashes`, how many
        pages to keep: the most k whose window pages before k are all held."""
        run = 0  # labelled pages ending at page k - 1
        best = 0
        for k, h in enumerate(hashes, 1):
            run = run + 1 if h in self._where else 0
            if run >= k - self._window_start(k):
                best = k
        return best

    def label(self, seq, first: int) -> None:
        """`seq`'s pages from `first` on are newly full and computed
        (hashes in its progress): label their ring pages, unless a step
        already reserved past them writes there."""
        if not seq.ring_base:
            return
        p, R = seq.progress, self.ring_pages
        for j in range(first, len(p.hashes)):
            if (j + R) * self.page_size >= p.num_reserved:
                self._set(seq.ring_base + j % R, j, p.hashes[j])

    def written(self, seq, start: int, stop: int) -> None:
        """A planned step writes `seq`'s positions [start, stop): the ring
        pages they land on lose their labels."""
        if not seq.ring_base or stop <= start:
            return
        ps, R = self.page_size, self.ring_pages
        last = (stop - 1) // ps
        for b in range(max(start // ps, last - R + 1), last + 1):
            self._drop(seq.ring_base + b % R)

    # ------------------------------------------------------------ seats
    def take(self, seq, hashes: list[bytes] = ()) -> None:
        """Give `seq` a seat (its `ring_base`). With `hashes`, a prefix hit
        of that many pages (capped by `hit_cap`): the window pages before
        it are put in place, copied where the seat does not hold them."""
        if not self.ring_pages:
            return
        if not self._free:
            raise RuntimeError(f"hybrid KV pool: no free seat for sequence {seq.request_id!r}")
        R, k = self.ring_pages, len(hashes)
        want = [(j, hashes[j]) for j in range(self._window_start(k), k)] if k else []
        in_place: dict[int, int] = {}
        for j, h in want:
            page = self._where[h]
            if (page - 1) % R == j % R:
                in_place[self._seat(page)] = in_place.get(self._seat(page), 0) + 1
        free = [s for s in self._free if s in in_place]
        if free:
            seat = max(free, key=lambda s: in_place[s])
        else:  # the free seat whose ring holds least, longest free first
            seat = min(self._free, key=lambda s: self._count[s])
        self._free.remove(seat)
        base = seq.ring_base = 1 + seat * R
        for j, h in want:
            dst = base + j % R
            if self._label.get(dst) == (j, h):
                self.pages_in_place += 1
                continue
            self._copies.append((self._where[h], dst))
            self._drop(dst)
            self.pages_copied += 1

    def free(self, seq) -> None:
        """`seq` stops running; its ring keeps its labels until written."""
        if seq.ring_base:
            self._free.append(self._seat(seq.ring_base))
            seq.ring_base = 0

    def fork(self, parent, child) -> None:
        """Seat `child` with a copy of `parent`'s ring (queued for the next step)."""
        self.take(child)
        if self.ring_pages:
            for j in range(self.ring_pages):
                self._copies.append((parent.ring_base + j, child.ring_base + j))
                self._drop(child.ring_base + j)

    def take_copies(self) -> list[tuple[int, int]]:
        """The ring copies queued since the last call (local page pairs)."""
        out, self._copies = self._copies, []
        return out
