"""One record per running sequence of where it stands in the engine: its
pages, the K/V slots reserved and written, and what the steps in flight
will add (vLLM's `num_computed_tokens` idea, with the counts it implies
named apart).

The block manager makes the record when it admits a sequence (or forks
one) and changes the page counts only when the scheduler asks it to
(`allocate`, `append_slots`, `mark_computed`, `trim`, `release_range`);
the scheduler alone advances the in-flight counts, as it dispatches steps
and reads them back. Nothing else writes it. Counts, all in tokens
(positions):

    num_computed     K/V written, as read back from the steps run; the
                     prefix cache names full pages up to here
    num_reserved     K/V slots reserved (its pages cover positions below it)
    inflight_steps   dispatched steps holding it, not read yet
    inflight_tokens  tokens those steps sample for it
    inflight_end     position after the last K/V they write (0: none)
    evicted          importance eviction (`jaxkv.core.kv.evict`): positions
                     whose K/V was dropped; position p's K/V sits at kv
                     index p - evicted, which the pages count

and `num_scheduled`, the K/V written once every dispatched step has run:
where the next step's rows start.
"""

from __future__ import annotations

import numpy as np

from jaxkv.core.scheduling.page_pool import ROOT_HASH


class Progress:
    """`pages` [capacity] int32 is the block table (page 0, the trash page,
    past `num_pages` and where a window released a page); `hashes[i]` the
    chain hash of full computed page i (with prefix caching), `root` the
    parent hash of page 0 (`page_pool.salted_root`)."""

    __slots__ = (
        "pages",
        "num_pages",
        "hashes",
        "root",
        "num_reserved",
        "num_computed",
        "inflight_steps",
        "inflight_tokens",
        "inflight_end",
        "evicted",
        "score_from",
    )

    def __init__(
        self,
        pages,
        num_reserved: int,
        num_computed: int,
        hashes: list[bytes],
        root: bytes = ROOT_HASH,
        capacity: int = 0,
    ):
        self.num_pages = len(pages)
        self.pages = np.zeros(max(capacity, self.num_pages, 1), np.int32)
        self.pages[: self.num_pages] = pages
        self.hashes = hashes
        self.root = root
        self.num_reserved = num_reserved
        self.num_computed = num_computed
        self.inflight_steps = 0
        self.inflight_tokens = 0
        self.inflight_end = 0
        self.evicted = 0  # importance eviction: positions whose K/V was dropped
        self.score_from = 1 << 30  # ... the kv index from which its rows are scored

    @property
    def num_scheduled(self) -> int:
        """Tokens whose K/V is in the cache once the steps in flight ran."""
        return self.num_computed if self.inflight_end < self.num_computed else self.inflight_end

    def page_list(self) -> list[int]:
        return self.pages[: self.num_pages].tolist()

    def add_pages(self, pages: list[int]) -> None:
        n = self.num_pages + len(pages)
        if n > len(self.pages):
            grown = np.zeros(max(n, 2 * len(self.pages)), np.int32)
            grown[: self.num_pages] = self.pages[: self.num_pages]
            self.pages = grown
        self.pages[self.num_pages : n] = pages
        self.num_pages = n

    def drop_pages(self, keep: int) -> list[int]:
        """Cut the table to `keep` pages; returns the pages cut."""
        cut = self.pages[keep : self.num_pages].tolist()
        self.pages[keep : self.num_pages] = 0
        self.num_pages = min(self.num_pages, keep)
        return cut

    def copy(self) -> Progress:
        """A fork's record: the same pages, counts and hashes."""
        c = Progress(
            [], self.num_reserved, self.num_computed, list(self.hashes), self.root, len(self.pages)
        )
        c.pages[:] = self.pages
        c.num_pages = self.num_pages
        return c
