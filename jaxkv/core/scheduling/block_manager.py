"""Block tables for the paged KV cache: which pages each sequence holds, how
many slots it reserved and how many tokens are computed, prefix caching by
chained page hashes, copy-on-write for shared pages.

Plain Python, no jax: the scheduler asks this module *where* each token's K/V
lives; the device only ever sees the resulting int32 block tables and slot
mappings. The pool of pages under it (free / evictable / held, refcounts,
the prefix cache's page hashes) is `jaxkv.core.scheduling.page_pool`.

How the scheduler drives it, per sequence (ids are any hashable):

1. ``cached = allocate(seq_id, prompt_ids)`` admits a prompt. Pages holding an
   already computed prefix are shared (their refcount goes up) and ``cached``
   (a multiple of ``page_size``, always ``< len(prompt_ids)``) prompt tokens
   need no prefill: only ``prompt_ids[cached:]`` are run.
2. Before a step that writes K/V for ``n`` more tokens (a prefill chunk past
   what ``allocate`` reserved, or one decode token), call
   ``copies = append_slots(seq_id, n)``. It grows the block table page by
   page and returns copy-on-write pairs ``[(src, dst), ...]``: the device
   must copy page ``src`` to page ``dst`` (all layers, K and V, scales) before
   that step's K/V writes. Pairs arise only when the sequence's partially
   filled last page is shared (after ``fork``).
3. After the step has written the K/V, call
   ``mark_computed(seq_id, token_ids, num_computed_tokens)`` with all tokens
   known so far (prompt + generated) and how many now have K/V. Newly full
   pages are hashed and become reusable by other prompts only then, so a
   page is never shared before its K/V exists.
4. ``free(seq_id)`` when the sequence finishes, aborts or is preempted;
   its hashed pages stay cached (evictable) until the pool runs short;
   ``trim`` gives back slots reserved for rejected speculative tokens.

Running out of pages raises ``OutOfPages`` and leaves the manager unchanged
(the scheduler preempts and retries; ``can_*`` ask without raising).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from jaxkv.core.progress import Progress
from jaxkv.core.scheduling.page_pool import ROOT_HASH, TRASH_PAGE, PagePool, hash_page  # noqa: F401


class OutOfPages(RuntimeError):
    """The pool cannot satisfy an allocation even after evicting every
    unreferenced cached page. The manager's state is unchanged; the scheduler
    should preempt a sequence (free it) and retry, or wait."""


class UnknownSequenceError(LookupError):
    """A sequence id that is not allocated: never allocated, or already freed
    (a double free)."""


class BlockManager(PagePool):
    """Page pool of ``num_pages`` pages (page 0 reserved) of ``page_size``
    token slots each (protocol: the module docstring). Without prefix
    caching freed pages go straight back to the free list. Each admitted
    sequence has one `Progress` record (`progress(seq_id)`); ``pages_per_seq``
    sizes its block table row (it grows past that if a sequence does)."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        pages_per_seq: int | None = None,
    ):
        super().__init__(num_pages, page_size, enable_prefix_caching)
        self.pages_per_seq = pages_per_seq or num_pages - 1
        self._seqs: dict[Hashable, Progress] = {}

    # ------------------------------------------------------------------ queries

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def progress(self, seq_id: Hashable) -> Progress:
        """The sequence's record (its block table row and counts; not a copy)."""
        return self._seq(seq_id)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's pages in position order (a copy): token at position
        ``pos`` lives in page ``table[pos // page_size]``."""
        return self._seq(seq_id).page_list()

    def num_reserved(self, seq_id: Hashable) -> int:
        """K/V slots reserved for the sequence (its K/V length after the
        next step)."""
        return self._seq(seq_id).num_reserved

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Tokens whose K/V is written, as last reported by ``mark_computed``
        (or served from the prefix cache by ``allocate``)."""
        return self._seq(seq_id).num_computed

    # ----------------------------------------------------------------- planning

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _allocate_plan(self, num_tokens: int, hit_pages: list[int]) -> tuple[int, bool]:
        """(new pages needed, whether the pool can supply them) for a new
        sequence reserving ``num_tokens`` slots on top of ``hit_pages``."""
        need = max(self._pages_for(num_tokens) - len(hit_pages), 0)
        # Reusing an evictable hit takes it out of the pool it would come from.
        revived = sum(1 for p in hit_pages if self._refcount[p] == 0)
        return need, need <= self.num_free_pages - revived

    def can_allocate(
        self, num_tokens: int, token_ids: Sequence[int] | None = None, root: bytes = ROOT_HASH
    ) -> bool:
        """Whether a new sequence reserving ``num_tokens`` slots fits now.
        With ``token_ids`` (its prompt), cached prefix pages count as free."""
        hit_pages = self._lookup_prefix(token_ids, root)[0] if token_ids is not None else []
        return self._allocate_plan(num_tokens, hit_pages)[1]

    def _append_plan(self, s: Progress, num_new_tokens: int) -> tuple[int, bool]:
        """(new pages needed for growth, whether a copy-on-write is needed)."""
        if num_new_tokens <= 0:
            return 0, False
        need = self._pages_for(s.num_reserved - s.evicted + num_new_tokens) - s.num_pages
        cow = (s.num_reserved - s.evicted) % self.page_size != 0 and self._refcount[
            int(s.pages[s.num_pages - 1])
        ] > 1
        return need, cow

    def can_append_slots(self, seq_id: Hashable, num_new_tokens: int) -> bool:
        """Whether ``append_slots(seq_id, num_new_tokens)`` would succeed."""
        need, cow = self._append_plan(self._seq(seq_id), num_new_tokens)
        return need + cow <= self.num_free_pages

    # ---------------------------------------------------------------- mutations

    def allocate(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        num_reserved: int | None = None,
        root: bytes = ROOT_HASH,
        cache_hits: bool = True,
        hit_cap=None,
    ) -> int:
        """Admit a new sequence with prompt ``token_ids``; return how many
        prompt tokens are already cached (their K/V is shared, skip them in
        prefill). The result is a multiple of ``page_size`` and always less
        than ``len(token_ids)``, so at least the last prompt token is run and
        yields logits.

        Reserves ``num_reserved`` slots (default: the whole prompt; pass less to
        prefill in chunks and grow with ``append_slots``), never fewer than
        the cached tokens. ``hit_cap(hashes)``: how many of the hit's pages to keep
        (`Seats.hit_cap`). Raises ``OutOfPages`` (nothing changed) when the pool
        cannot hold them, ``ValueError`` if ``seq_id`` is already live."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if len(token_ids) == 0:
            raise ValueError("token_ids: a prompt needs at least one token")
        if num_reserved is None:
            num_reserved = len(token_ids)
        if num_reserved < 0:
            raise ValueError(f"num_reserved: must be non-negative, got {num_reserved}")
        hit_pages, hit_hashes = self._lookup_prefix(token_ids, root) if cache_hits else ([], [])
        if hit_cap is not None and hit_pages:
            k = hit_cap(hit_hashes)
            hit_pages, hit_hashes = hit_pages[:k], hit_hashes[:k]
        tier_hits = (
            self._tier_hits(token_ids, hit_hashes, root) if cache_hits and not hit_cap else []
        )
        cached = (len(hit_pages) + len(tier_hits)) * self.page_size
        num_reserved = max(num_reserved, cached)
        need, ok = self._allocate_plan(num_reserved, hit_pages)
        if not ok:
            self._unpin_hits(tier_hits)
            raise OutOfPages(
                f"sequence {seq_id!r} needs {need} new pages for {num_reserved} slots "
                f"({len(hit_pages)} cached), {self.num_free_pages} free or evictable"
            )
        for p in hit_pages:
            self._hold(p)
        new = [self._take_page() for _ in range(need)]
        ps, parent = self.page_size, hit_hashes[-1] if hit_hashes else root
        for i, (p, (h, where)) in enumerate(zip(new, tier_hits), len(hit_pages)):
            self._load(p, h, where, parent, token_ids[i * ps : (i + 1) * ps])  # from a tier
            parent = h
        self._seqs[seq_id] = Progress(
            hit_pages + new,
            num_reserved,
            cached,
            hit_hashes + [h for h, _ in tier_hits],
            root,
            self.pages_per_seq,
        )
        self.prefix_query_tokens += len(token_ids)
        self.prefix_hit_pages += len(hit_pages) + len(tier_hits)
        self.prefix_hit_tokens += cached
        return cached

    def append_slots(self, seq_id: Hashable, num_new_tokens: int) -> list[tuple[int, int]]:
        """Reserve slots for ``num_new_tokens`` more positions, adding pages
        only as the length crosses page boundaries. Returns copy-on-write
        pairs ``[(src, dst)]``: when the partially filled last page is shared
        (refcount > 1, after ``fork``) the sequence gets a fresh page ``dst``
        and the device must copy ``src`` into it before this step writes K/V.
        A page is thus only ever written by its single holder.

        Raises ``OutOfPages`` (nothing changed) when the pool is short.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens: must be non-negative, got {num_new_tokens}")
        s = self._seq(seq_id)
        need, cow = self._append_plan(s, num_new_tokens)
        if need + cow > self.num_free_pages:
            raise OutOfPages(
                f"sequence {seq_id!r} needs {need + cow} new pages to grow by "
                f"{num_new_tokens} tokens, {self.num_free_pages} free or evictable"
            )
        copies = []
        if cow:
            src = int(s.pages[s.num_pages - 1])
            dst = self._take_page()
            self._refcount[src] -= 1  # stays >= 1: another sequence holds it
            s.pages[s.num_pages - 1] = dst
            copies.append((src, dst))
        if need:
            s.add_pages([self._take_page() for _ in range(need)])
        s.num_reserved += num_new_tokens
        return copies

    def mark_computed(
        self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Record that K/V for the first ``num_computed_tokens`` of
        ``token_ids`` (all tokens known so far, prompt then generated) is
        written. Call after every step that wrote K/V for the sequence.

        Each newly full page is hashed and registered in the prefix cache, so
        later prompts can reuse it. If another page already caches the same
        prefix, this one stays private. ``ValueError`` on counts outside
        ``[num_computed_tokens(seq_id), num_reserved(seq_id)]`` or tokens that
        disagree with a page's cached hash.
        """
        s = self._seq(seq_id)
        if not s.num_computed <= num_computed_tokens <= s.num_reserved:
            raise ValueError(
                f"num_computed_tokens {num_computed_tokens} outside "
                f"[{s.num_computed}, {s.num_reserved}] for sequence {seq_id!r}"
            )
        if len(token_ids) < num_computed_tokens:
            raise ValueError(
                f"only {len(token_ids)} token ids for {num_computed_tokens} computed tokens"
            )
        if self.enable_prefix_caching:
            ps = self.page_size
            for i in range(len(s.hashes), num_computed_tokens // ps):
                parent = s.hashes[-1] if s.hashes else s.root
                h = hash_page(parent, token_ids[i * ps : (i + 1) * ps])
                # Pages past s.hashes are this sequence's own (prefix hits and
                # fork-shared pages arrive with their hashes), so unregistered.
                self._register(int(s.pages[i]), h, parent, token_ids[i * ps : (i + 1) * ps])
                s.hashes.append(h)
        s.num_computed = num_computed_tokens

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` share all of ``parent_id``'s pages (parallel
        sampling, beam search). The first write either makes into the shared
        partial last page triggers copy-on-write in ``append_slots``.

        The parent must have no reserved-but-unwritten slots (fork after
        ``mark_computed``), else both would write the same page.
        """
        s = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        if s.num_computed != s.num_reserved:
            raise ValueError(
                f"fork of {parent_id!r} with {s.num_reserved - s.num_computed} reserved but "
                "unwritten slots; call mark_computed first"
            )
        for p in s.page_list():
            if p != TRASH_PAGE:
                self._hold(p)
        self._seqs[child_id] = s.copy()

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's pages. Cached pages no one else holds become
        evictable; the sequence's tail pages are released first so they are
        evicted before the prefix pages they extend. ``UnknownSequenceError``
        on a double free."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            raise UnknownSequenceError(
                f"free of sequence {seq_id!r}: not allocated (unknown id or double free)"
            )
        for p in reversed(s.page_list()):
            if p != TRASH_PAGE:
                self._release_page(p)

    def release_range(self, seq_id: Hashable, start: int, stop: int) -> int:
        """Give back the pages lying wholly inside positions [start, stop) of
        a sequence that will never attend to them again (sliding window,
        attention-sink eviction). Their block-table entries become the trash
        page 0, so positions keep their page index; attention must mask those
        positions. A cached page stays reusable by prefix hits. Returns the
        number of pages released."""
        s = self._seq(seq_id)
        ps = self.page_size
        first = -(-max(start, 0) // ps)
        last = min(stop // ps, s.num_pages)
        n = 0
        for j in range(first, last):
            p = int(s.pages[j])
            if p != TRASH_PAGE:
                self._release_page(p)
                s.pages[j] = TRASH_PAGE
                n += 1
        return n

    def trim(self, seq_id: Hashable, num_reserved: int) -> int:
        """Keep only the first ``num_reserved`` reserved slots (never fewer
        than the computed ones); pages past them go back to the pool (they
        were this sequence's own, never hashed). Returns pages released."""
        s = self._seq(seq_id)
        s.num_reserved = max(s.num_computed, min(s.num_reserved, num_reserved))
        keep = self._pages_for(s.num_reserved - s.evicted)
        if keep >= s.num_pages:
            return 0
        extra = s.drop_pages(keep)
        for p in reversed(extra):
            self._release_page(p)
        return len(extra)

    def compact(self, seq_id: Hashable, keep: int) -> int:
        """Importance eviction: the sequence keeps `keep` tokens of K/V (its
        first slots); positions run on. Returns pages released."""
        s = self._seq(seq_id)
        s.evicted = s.num_reserved - keep
        return self.trim(seq_id, s.num_reserved)

    # ---------------------------------------------------------------- internals

    def _seq(self, seq_id: Hashable) -> Progress:
        s = self._seqs.get(seq_id)
        if s is None:
            raise UnknownSequenceError(f"sequence {seq_id!r} is not allocated")
        return s
