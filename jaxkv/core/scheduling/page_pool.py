"""The page pool under the block manager: which pages are free, held or
cached, with refcounts and the prefix cache.

Pages are ints ``1 .. num_pages-1``; page 0 is the trash page that padded
tokens write to, so it is never handed out. Every page is in exactly one of
three states:

- free: never used or no longer cached, no holder (``free_pages()``);
- evictable: no holder, but it holds a full, computed, hashed page of tokens
  that a later prompt with the same prefix may reuse (``evictable_pages()``,
  least recently released first: eviction takes from the front);
- held: ``refcount(page) > 0`` sequences hold it in their block tables.

A cached page is named by a chained hash of the tokens it holds and of every
page before it (`hash_page`), so equal names mean equal K/V.

With a host tier (`tier`, `jaxkv.core.kv.tiers`) an evicted cached page is
queued to be copied out (`transfers.outs`) before it is handed out again,
and prefixes go on into the tier (`_tier_hits`; their loads queued in
`transfers.ins`).

With `events` set to a list, the pool records what enters and leaves the
prefix cache, for KV events (`jaxkv.entrypoints.openai.kv_events`):
("stored", hash, parent hash, token ids), ("removed", hash) and
("cleared",).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from jaxkv.core.kv.tiers import TierTransfers

TRASH_PAGE = 0
ROOT_HASH = b""


def hash_page(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash identifying one full page: blake2b over the parent page's
    hash and this page's token ids. Chaining makes the hash name the whole
    prefix, so equal hashes mean equal K/V (positions and all earlier tokens
    agree). 128 bits make an accidental collision, which would silently reuse
    wrong K/V, practically impossible; the value is stable across processes."""
    h = hashlib.blake2b(parent_hash, digest_size=16)
    h.update(np.asarray(token_ids, np.int64).tobytes())
    return h.digest()


def prompt_page_hashes(token_ids: Sequence[int], page_size: int, root: bytes = ROOT_HASH) -> list:
    """The chained hashes of a prompt's full pages that a prefix hit may
    cover (never the last token's page: its logits must be computed), as a
    pool starting from `root` names them."""
    out, parent = [], root
    for i in range((len(token_ids) - 1) // page_size):
        parent = hash_page(parent, token_ids[i * page_size : (i + 1) * page_size])
        out.append(parent)
    return out


def salted_root(cache_salt: str | None, adapter: bytes | None = None) -> bytes:
    """The parent hash of a sequence's first page. A request's `cache_salt`
    (a tenant's secret) changes it, so the whole hash chain differs: pages
    are shared only between requests with the same salt, and a tenant cannot
    learn from timings whether another tenant's prompt is cached. A LoRA
    adapter's identity (`jaxkv.core.adapters.lora.Adapter.key`) changes it too: its
    K/V differ from the base model's."""
    if cache_salt is None and adapter is None:
        return ROOT_HASH
    h = hashlib.blake2b(b"jaxkv-cache-salt:", digest_size=16)
    if cache_salt is not None:  # length-prefixed: no salt can pose as salt + adapter
        salt = cache_salt.encode("utf-8")
        h.update(len(salt).to_bytes(8, "little") + salt)
    if adapter is not None:
        h.update(b"lora:" + adapter)
    return h.digest()


class PagePool:
    """``num_pages`` pages (page 0 reserved) of ``page_size`` token slots."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 2:
            raise ValueError(f"num_pages: need at least 2 (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size: must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(1, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refcount = [0] * num_pages
        self._page_hash: dict[int, bytes] = {}
        self._hash_to_page: dict[bytes, int] = {}
        self.num_evictions = 0  # cached pages dropped to make room
        # Cumulative counters for metrics and tests (BlockManager.allocate).
        self.prefix_query_tokens = 0  # prompt tokens of successful allocate calls
        self.prefix_hit_pages = 0  # pages reused from the cache (or a tier) by allocate
        self.prefix_hit_tokens = 0  # prompt tokens those pages covered
        self.tier = None  # a kv_tiers.HostTier, set by the engine
        self.transfers = TierTransfers()
        self._loading: dict[int, bytes] = {}  # page -> hash of its queued load
        self.events: list | None = None  # KV events recorded, when someone listens

    # ------------------------------------------------------------------ queries

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of all prompt tokens served from the prefix cache."""
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: free plus evictable cached pages."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no sequence holds (reusable on a hit, evicted LRU first)."""
        return len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache, held or evictable."""
        return len(self._page_hash)

    @property
    def num_used_pages(self) -> int:
        """Pages held by at least one sequence."""
        return self.num_pages - 1 - self.num_free_pages

    def refcount(self, page: int) -> int:
        """Number of block tables holding ``page``."""
        return self._refcount[page]

    def page_hash(self, page: int) -> bytes | None:
        """The prefix-cache hash registered for ``page``, or None."""
        return self._page_hash.get(page)

    def page_of(self, h: bytes) -> int | None:
        """The page caching hash `h`, or None."""
        return self._hash_to_page.get(h)

    def cached_pages(self) -> list[tuple[int, bytes]]:
        """(page, hash) of every page in the prefix cache, held or evictable."""
        return list(self._page_hash.items())

    def free_pages(self) -> list[int]:
        """Unheld, uncached pages in the order they will be handed out."""
        return list(self._free)

    def evictable_pages(self) -> list[int]:
        """Unheld cached pages, least recently released (next evicted) first."""
        return list(self._evictable)

    # ------------------------------------------------------------- prefix cache

    def _lookup_prefix(
        self, token_ids: Sequence[int], root: bytes = ROOT_HASH
    ) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full pages that prefixes ``token_ids`` (a
        chain starting from ``root``), never covering the last token (its
        logits must be computed)."""
        if not self.enable_prefix_caching:
            return [], []
        ps = self.page_size
        pages: list[int] = []
        hashes: list[bytes] = []
        parent = root
        for i in range((len(token_ids) - 1) // ps):
            h = hash_page(parent, token_ids[i * ps : (i + 1) * ps])
            page = self._hash_to_page.get(h)
            if page is None:
                break
            pages.append(page)
            hashes.append(h)
            parent = h
        return pages, hashes

    def _register(self, page: int, h: bytes, parent: bytes, token_ids: Sequence[int]) -> None:
        """Name ``page`` by ``h`` (the page after ``parent`` holding
        ``token_ids``), unless another page already caches that prefix (then
        this one stays private)."""
        if h not in self._hash_to_page:
            self._page_hash[page] = h
            self._hash_to_page[h] = page
            if self.events is not None:
                self.events.append(("stored", h, parent, list(token_ids)))

    def flush(self) -> int:
        """Drop every cached page no sequence holds (they become free) and
        return how many; held pages stay cached."""
        dropped = list(self._evictable)
        hashes = [self._page_hash.pop(page) for page in dropped]
        for h in hashes:
            del self._hash_to_page[h]
        self._evictable.clear()
        self._free.extend(dropped)
        if self.events is not None:
            if not self._page_hash:
                self.events.append(("cleared",))
            else:
                self.events.extend(("removed", h) for h in hashes)
        return len(dropped)

    # ------------------------------------------------------------ page moves

    def _hold(self, page: int) -> None:
        """One more block table holds ``page`` (a prefix hit or a fork)."""
        if self._refcount[page] == 0:
            del self._evictable[page]
        self._refcount[page] += 1

    def _take_page(self) -> int:
        """Hand out a free page, else evict the least recently released cached
        page. Callers have checked that one exists."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            h = self._page_hash.pop(page)
            del self._hash_to_page[h]
            self.num_evictions += 1
            if self.events is not None:
                self.events.append(("removed", h))
            if self.tier is not None:
                self._offload(page, h)
        self._refcount[page] = 1
        return page

    def _offload(self, page: int, h: bytes) -> None:
        """Page `page` (cached as `h`) is about to be reused: queue its copy
        to the host tier, unless its load from there is still queued (then
        the tier has it: the load is dropped)."""
        if self._loading.get(page) == h:
            del self._loading[page]
            self.transfers.ins = [(p, x) for p, x in self.transfers.ins if p != page]
            self.tier.unpin(h)
        elif not self.tier.holds(h):
            self.tier.reserve(h)
            self.transfers.outs.append((page, h))

    def _tier_hits(
        self, token_ids: Sequence[int], hit_hashes: list[bytes], root: bytes
    ) -> list[tuple[bytes, str]]:
        """(hash, "host" or "disk") of the full pages after the device hit
        (`hit_hashes`) that the host or disk tier holds, in a run (never the
        last token), each pinned (a `_load` keeps the pin, `_unpin_hits`
        drops it)."""
        if self.tier is None or not self.enable_prefix_caching:
            return []
        ps, out = self.page_size, []
        parent = hit_hashes[-1] if hit_hashes else root
        for i in range(len(hit_hashes), (len(token_ids) - 1) // ps):
            h = hash_page(parent, token_ids[i * ps : (i + 1) * ps])
            where = self.tier.find(h)
            if where is None:
                break
            self.tier.pin(h)  # before the next find can push it out
            out.append((h, where))
            parent = h
        return out

    def _load(self, page: int, h: bytes, where: str, parent: bytes, token_ids) -> None:
        """Page `page` takes cached page `h` (after `parent`, holding
        `token_ids`) from the tier (queued load)."""
        if where == "host":
            self.tier.stats.host_hit_pages += 1
        else:
            self.tier.stats.disk_hit_pages += 1
        self._register(page, h, parent, token_ids)
        self._loading[page] = h
        self.transfers.ins.append((page, h))

    def _unpin_hits(self, hits) -> None:
        for h, _ in hits:
            self.tier.unpin(h)

    def take_transfers(self) -> TierTransfers:
        """The queued page moves, for the executor to run before the next step."""
        moves, self.transfers = self.transfers, TierTransfers()
        self._loading.clear()
        return moves

    def _release_page(self, page: int) -> None:
        rc = self._refcount[page] - 1
        if rc < 0:
            raise RuntimeError(f"page {page} released more often than held")
        self._refcount[page] = rc
        if rc == 0:
            if page in self._page_hash:
                self._evictable[page] = None
            else:
                self._free.append(page)
