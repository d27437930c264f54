"""KV beyond the device pool: a host-memory tier, and optionally a disk tier,
for the pages leaving the device prefix cache, keyed by the same chained
page hashes (cache salt and adapter included: `page_pool.salted_root`).

How pages move (`jaxkv.core.scheduling.page_pool` queues, `jaxkv.core.executor` moves):

- out: a cached page the device pool evicts to hand it out again is queued
  (`TierTransfers.outs`); before the step that reuses it, the executor
  dispatches the copy of every queued page to the host in batches
  (`page_io.page_out_later`), and the tier takes the data (`settle`) when
  the next moves come or a page is first needed, so a step in flight runs
  on meanwhile. A preempted sequence's full pages are cached pages like
  any other: when the pool needs them they go to the host, and the
  sequence's resumed prompt finds them there (swap, not recompute; only its
  partial last page is computed again).
- in: a prompt whose prefix goes on past the device's hits into a tier gets
  fresh pages for those hits, each with a queued load, applied in batches
  (`page_io.page_in`) before the step that reads them.
- host -> disk: the host tier is LRU over `capacity` pages; with a
  `DiskTier` the page it drops is written there (`jaxkv.core.kv.disk`), and
  a disk hit is read back, checked, into the host tier when it is found.

Pages promised to a sequence (queued loads) are pinned until loaded, so the
LRU never drops them first.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict

import numpy as np

from jaxkv.worker import page_io

log = logging.getLogger("jaxkv")

PageData = list  # one array per paged cache leaf, [KVH, page_size, ...], of one page


@dataclasses.dataclass
class TierStats:
    """Cumulative counters (LLMEngine.stats, /metrics)."""

    host_hit_pages: int = 0  # prompt pages served from the host tier
    disk_hit_pages: int = 0  # ... from the disk tier
    pages_out: int = 0  # device -> host copies
    pages_in: int = 0  # host -> device copies
    bytes_out: int = 0
    bytes_in: int = 0
    disk_writes: int = 0  # pages written to the disk tier
    disk_reads: int = 0  # pages read back from it
    disk_skipped: int = 0  # corrupt, truncated or foreign files skipped
    copy_seconds: float = 0.0  # time spent moving pages (both ways, disk included)


class HostTier:
    """Up to `capacity` pages in host memory, LRU, over an optional `disk`
    (`jaxkv.core.kv.disk.DiskTier`) that takes the pages it drops."""

    def __init__(self, capacity: int, page_bytes: int, disk=None):
        if capacity < 1:
            raise ValueError(f"kv_offload_memory holds no page ({page_bytes} bytes each)")
        self.capacity = capacity
        self.page_bytes = page_bytes
        self.disk = disk
        self._pages: OrderedDict[bytes, PageData | None] = OrderedDict()  # None: data on its way
        self._pins: dict[bytes, int] = {}
        self._arriving: list[tuple[list[bytes], object]] = []  # (hashes, page_io.page_out_later)
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def nbytes(self) -> int:
        """Host bytes held (pages with data)."""
        return sum(1 for d in self._pages.values() if d is not None) * self.page_bytes

    def hashes(self) -> list[bytes]:
        """The host tier's page hashes, least recently used first."""
        return list(self._pages)

    def ready(self, h: bytes) -> bool:
        """Whether page `h`'s data is here (not still on its way)."""
        return self._pages.get(h) is not None

    def pinned(self, h: bytes) -> bool:
        return h in self._pins

    def holds(self, h: bytes) -> bool:
        """Whether the host tier has (or is about to have) page `h`."""
        return h in self._pages

    def find(self, h: bytes) -> str | None:
        """ "host" or "disk" when page `h` can be loaded (a disk page is read
        and checked now, into the host tier), else None."""
        if h in self._pages:
            self._pages.move_to_end(h)
            return "host"
        if self.disk is None or h not in self.disk:
            return None
        t0 = time.perf_counter()
        data = self.disk.read(h)
        self.stats.copy_seconds += time.perf_counter() - t0
        if data is None:  # skipped (the disk tier logged why)
            self.stats.disk_skipped += 1
            return None
        self.stats.disk_reads += 1
        self._pages[h] = data  # trimmed once the caller's pin is dropped (`unpin`)
        return "disk"

    def reserve(self, h: bytes) -> None:
        """Page `h` is on its way from the device (`put` brings its data)."""
        if h not in self._pages:
            self._pages[h] = None
        self._pages.move_to_end(h)

    def arriving(self, hashes: list[bytes], wait) -> None:
        """Pages `hashes` (reserved) come from a dispatched copy: `wait()`
        gives their data, taken by `settle` (the step in flight runs on)."""
        self._arriving.append((hashes, wait))

    def settle(self) -> None:
        """Take the data of every dispatched copy (waits for them)."""
        t0 = time.perf_counter()
        arriving, self._arriving = self._arriving, []
        for hashes, wait in arriving:
            data = wait()
            for j, h in enumerate(hashes):
                if h in self._pages:  # own copies: the batch is freed
                    self._pages[h] = [np.array(x[j]) for x in data]
        if arriving:
            self.stats.copy_seconds += time.perf_counter() - t0
            self._trim()

    def get(self, h: bytes) -> PageData:
        if self._pages.get(h) is None and self._arriving:
            self.settle()
        data = self._pages[h]
        if data is None:
            raise RuntimeError(f"page {h.hex()} was queued for the host tier and never copied")
        return data

    def pin(self, h: bytes) -> None:
        self._pins[h] = self._pins.get(h, 0) + 1

    def unpin(self, h: bytes) -> None:
        n = self._pins.pop(h) - 1
        if n:
            self._pins[h] = n
        elif len(self._pages) > self.capacity:
            self._trim()

    def receive(self, pages: list[tuple[bytes, PageData]]) -> None:
        """Take pages computed elsewhere (a prefill server's handoff), most
        recently used: the prompt that follows finds them as host hits."""
        for h, data in pages:
            self._pages[h] = data
            self._pages.move_to_end(h)
        self._trim()

    def clear(self) -> int:
        """Drop every host page that is neither pinned nor on its way (not to
        the disk tier: a flush means to forget); returns how many."""
        self.settle()
        drop = [h for h, d in self._pages.items() if d is not None and h not in self._pins]
        for h in drop:
            del self._pages[h]
        return len(drop)

    def _trim(self) -> None:
        """Drop least recently used pages past `capacity` (to the disk tier,
        when there is one), never a pinned page or one whose data is still
        on its way."""
        over = len(self._pages) - self.capacity
        for h in list(self._pages):
            if over <= 0:
                break
            data = self._pages[h]
            if data is None or h in self._pins:
                continue
            del self._pages[h]
            over -= 1
            if self.disk is not None and h not in self.disk:
                t0 = time.perf_counter()
                if self.disk.write(h, data):
                    self.stats.disk_writes += 1
                self.stats.copy_seconds += time.perf_counter() - t0


@dataclasses.dataclass
class TierTransfers:
    """Page moves queued by the pool for the executor, in the order they
    must run: every out before every in (an out reads a page that an in
    may then overwrite; an in may read a page an out just saved)."""

    outs: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)  # (page, hash)
    ins: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.outs or self.ins)


def tier_metrics(tier: HostTier | None, page_size: int) -> dict:
    """The tiers' figures ({} without a host tier): prompt tokens served from
    each tier, pages and bytes moved each way, seconds spent copying, bytes
    and pages each tier holds (and its bound)."""
    if tier is None:
        return {}
    st, disk = tier.stats, tier.disk
    return dict(
        host_hit_tokens=st.host_hit_pages * page_size,
        disk_hit_tokens=st.disk_hit_pages * page_size,
        pages_out=st.pages_out,
        pages_in=st.pages_in,
        bytes_out=st.bytes_out,
        bytes_in=st.bytes_in,
        disk_writes=st.disk_writes,
        disk_reads=st.disk_reads,
        disk_skipped=st.disk_skipped,
        copy_seconds=st.copy_seconds,
        host_pages=len(tier),
        host_capacity_pages=tier.capacity,
        host_bytes=tier.nbytes,
        host_max_bytes=tier.capacity * tier.page_bytes,
        disk_pages=len(disk) if disk else 0,
        disk_bytes=disk.nbytes if disk else 0,
        disk_max_bytes=disk.max_bytes if disk else 0,
    )


def apply_transfers(runner, tier: HostTier, moves: TierTransfers) -> None:
    """Run queued moves on `runner`: copy the outs' pages to the host tier,
    then load the ins' pages from it (before the step that needs them)."""
    if not moves:
        return
    tier.settle()  # the copies dispatched with the step before (done by now, mostly)
    t0 = time.perf_counter()
    st = tier.stats
    if moves.outs:  # read when the next moves come, or when a page is needed first
        tier.arriving(
            [h for _, h in moves.outs], page_io.page_out_later(runner, [p for p, _ in moves.outs])
        )
        st.pages_out += len(moves.outs)
        st.bytes_out += len(moves.outs) * tier.page_bytes
    if moves.ins:
        pages = [tier.get(h) for _, h in moves.ins]
        page_io.page_in(runner, [p for p, _ in moves.ins], [np.stack(leaf) for leaf in zip(*pages)])
        for _, h in moves.ins:
            tier.unpin(h)
        st.pages_in += len(moves.ins)
        st.bytes_in += len(moves.ins) * tier.page_bytes
    st.copy_seconds += time.perf_counter() - t0


def make_tier(
    config, runner, model, kv_dtype: str, *, hybrid: bool, draft: bool
) -> HostTier | None:
    """The engine's host tier (over a disk tier with `kv_offload_dir`), or
    None without `kv_offload_memory`. Sized in whole pages of the runner's
    cache; refuses, by name, what it does not serve yet."""
    if config.kv_offload_memory is None:
        return None
    import jax

    for cond, what in (
        (hybrid, "a hybrid KV pool (pass hybrid_kv_cache=False)"),
        (draft, "a draft model's speculation (its cache would miss the loads)"),
        (jax.process_count() > 1, "several processes"),
    ):
        if cond:
            raise ValueError(f"kv_offload_memory: the host tier does not serve {what} yet")
    from jaxkv.core.kv.disk import DiskTier, fingerprint
    from jaxkv.model.kv_cache import paged_leaves

    leaves = paged_leaves(runner.cache)
    layout = [((x.shape[0],) + tuple(x.shape[2:]), str(x.dtype)) for x in leaves]
    page_bytes = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in layout)
    disk = None
    if config.kv_offload_dir is not None:
        cache = runner.cache
        scales = [np.asarray(x) for x in cache.k_scale + cache.v_scale] if cache.fp8 else None
        disk = DiskTier(
            config.kv_offload_dir,
            fingerprint(model, layout, kv_dtype, config.page_size, scales),
            layout,
            config.kv_offload_disk,
        )
    tier = HostTier(config.kv_offload_memory // page_bytes, page_bytes, disk)
    log.info(
        "jaxkv: KV host tier of %d pages (%.1f MiB)%s",
        tier.capacity,
        tier.capacity * page_bytes / 2**20,
        f" over a disk tier of {config.kv_offload_disk / 2**30:.1f} GiB in {disk.dir}"
        if disk
        else "",
    )
    return tier


def persist(runner, tier: HostTier | None, pool) -> int:
    """Write what a disk tier does not hold yet of the device prefix cache
    (`pool.cached_pages()`) and of the host tier to it, so a restarted
    engine on the same directory finds it (at shutdown; within the disk's
    bound, least recently used first out). Returns pages written."""
    if tier is None or tier.disk is None:
        return 0
    tier.settle()
    disk, written = tier.disk, 0
    t0 = time.perf_counter()
    for h in tier.hashes():  # oldest first: the newest end up kept
        data = tier._pages[h]
        if data is not None and h not in disk:
            written += disk.write(h, data)
    device = [(p, h) for p, h in pool.cached_pages() if h not in disk]
    for i in range(0, len(device), 256):
        chunk = device[i : i + 256]
        data = page_io.page_out(runner, [p for p, _ in chunk])
        for j, (_, h) in enumerate(chunk):
            written += disk.write(h, [x[j] for x in data])
    tier.stats.disk_writes += written
    tier.stats.copy_seconds += time.perf_counter() - t0
    if written:
        log.info("jaxkv: KV disk tier: %d pages written for the next start (%s)", written, disk.dir)
    return written
