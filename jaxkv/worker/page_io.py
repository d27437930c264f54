"""Page-level moves of a Runner's cache beside its steps: a host tier's
copies out and in (`jaxkv.core.kv.tiers`), and importance eviction's
score reads and compaction (`jaxkv.core.kv.evict`). Each dispatches
compiled programs of fixed shape (`Programs`: "page_out" / "page_in" of
TRANSFER_WIDTH pages, "scores" / "compact" of one block table row) in
order with the steps, so a move lands between the steps around it.
One process only (the engine refuses these with several)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.sharding import to_host
from jaxkv.worker.programs import TRANSFER_WIDTH


def _chunks(pages: Sequence[int]):
    """(page ids padded to TRANSFER_WIDTH with the trash page, live count)."""
    for i in range(0, len(pages), TRANSFER_WIDTH):
        idx = np.zeros(TRANSFER_WIDTH, np.int32)
        n = len(pages[i : i + TRANSFER_WIDTH])
        idx[:n] = pages[i : i + TRANSFER_WIDTH]
        yield i, idx, n


def page_out_later(runner, pages: Sequence[int]):
    """Dispatch the copy of `pages` (it runs after the steps already in
    flight, before any later one) and return a call that waits for it and
    gives their contents: one array per paged cache leaf
    (`kv_cache.paged_leaves`), [len(pages), KVH, page_size, ...]."""
    prog = runner.programs.get(("page_out", TRANSFER_WIDTH))
    parts = [(prog(runner.cache, idx), n) for _, idx, n in _chunks(pages)]

    def wait() -> list[np.ndarray]:
        return [
            np.concatenate(p) for p in zip(*[[to_host(x)[:n] for x in out] for out, n in parts])
        ]

    return wait


def page_out(runner, pages: Sequence[int]) -> list[np.ndarray]:
    """The contents of `pages` now (`page_out_later`, waited for)."""
    return page_out_later(runner, pages)()


def page_in(runner, pages: Sequence[int], data: Sequence[np.ndarray]) -> None:
    """Write `data` (as `page_out` gives it) into `pages` before the next step."""
    prog = runner.programs.get(("page_in", TRANSFER_WIDTH))
    for i, idx, n in _chunks(pages):
        chunk = []
        for x in data:
            pad = np.zeros((TRANSFER_WIDTH,) + x.shape[1:], x.dtype)
            pad[:n] = x[i : i + n]
            chunk.append(pad)
        runner.cache = prog(runner.cache, idx, tuple(chunk))


def _row(runner, table) -> np.ndarray:
    W = runner.buckets.pages_per_seq
    row = np.zeros(W, np.int32)
    n = min(W, len(table))
    row[:n] = table[:n]
    return row


def read_scores(runner, table) -> np.ndarray:
    """[L, KVH, W * page_size] float32: the accumulated attention of the
    kv slots of block table row `table` (`jaxkv.model.kv_scores`)."""
    row = _row(runner, table)
    return np.asarray(to_host(runner.programs.get(("scores", len(row)))(runner.cache, row)))


def compact(runner, table, src: np.ndarray) -> None:
    """Move kv indices src [L, KVH, B] of row `table` to its first B slots
    (`jaxkv.model.kv_scores.compact_pages`)."""
    row = _row(runner, table)
    prog = runner.programs.get(("compact", len(row), src.shape[-1]))
    runner.cache = prog(
        runner.cache, row, np.ascontiguousarray(src, np.int32), np.asarray(src.shape[-1], np.int32)
    )
