"""Importance-based KV eviction (`kv_eviction="snapkv"` / `"h2o"`, within
`kv_budget` tokens per sequence): which tokens each layer and KV head
keeps, decided on the host from the attention they received
(`jaxkv.model.kv_scores` sums it on the device), and when.

- snapkv (SnapKV): the rows of a prompt's last `snapkv_window` tokens are
  scored; when the prompt's prefill ends with more than `kv_budget`
  tokens of K/V, each layer and KV head keeps the window itself and the
  `kv_budget - window` earlier tokens with the highest scores after a
  max-pool over `POOL` neighbours (a kept token brings its neighbours'
  claim, so phrases survive whole). Decoding then grows from there.
- h2o (H2O, heavy hitters): every row is scored, so each token's score is
  the attention it accumulated from every later query; whenever a
  sequence's K/V reaches `kv_budget` tokens it is cut to `kv_budget -
  page_size` (a page's worth of room, so a cut frees at least one page):
  the most recent half of those and the heaviest hitters before them.

A cut moves the kept tokens of each layer and KV head to the sequence's
first kv slots, in their order (`page_io.compact`), and gives the pages past
them back to the pool (`BlockManager.compact`); positions (RoPE) run on
past the kv indices (`Progress.evicted`, the plan's `pos_offset`). Every
step program keeps its shape: no program per request or per budget.
"""

from __future__ import annotations

import numpy as np

from jaxkv.model.kv_scores import NEVER
from jaxkv.worker import page_io

POOL = 7  # snapkv: neighbours pooled (a max-pool of this width, centred)


def _pooled(scores: np.ndarray, width: int) -> np.ndarray:
    """Max over the `width` neighbours centred on each token (last axis)."""
    n = scores.shape[-1]
    half = width // 2
    padded = np.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(half, half)], constant_values=-np.inf)
    win = np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1)
    return win.max(axis=-1)[..., :n]


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k highest scores of each row (last axis), ties to the
    earlier token; sorted."""
    order = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    return np.sort(order, axis=-1)


def snapkv_keep(scores: np.ndarray, n: int, budget: int, window: int) -> np.ndarray:
    """[L, KVH, budget] kv indices kept of `n` (> budget): the last `window`
    and the best pooled `budget - window` before them. `scores` [L, KVH, >=n]."""
    head = _top(_pooled(scores[..., : n - window], POOL), budget - window)
    tail = np.broadcast_to(np.arange(n - window, n), scores.shape[:-1] + (window,))
    return np.concatenate([head, tail], axis=-1).astype(np.int32)


def h2o_keep(scores: np.ndarray, n: int, keep: int) -> np.ndarray:
    """[L, KVH, keep] kv indices kept of `n`: the last keep // 2 tokens and
    the heaviest hitters among the rest."""
    recent = keep // 2
    head = _top(scores[..., : n - recent], keep - recent)
    tail = np.broadcast_to(np.arange(n - recent, n), scores.shape[:-1] + (recent,))
    return np.concatenate([head, tail], axis=-1).astype(np.int32)


class Evictor:
    """The engine's importance eviction: `annotate` a step's plan before it
    runs, `after_step` cuts what went over budget once it ran."""

    def __init__(self, method: str, budget: int, window: int, page_size: int, runner, bm):
        self.method = method
        self.budget = budget
        self.window = window
        self.page_size = page_size
        self.runner = runner
        self.bm = bm
        self.evicted_tokens = 0
        self.cuts = 0

    def _score_from(self, sc) -> int:
        """Kv index from which the step's rows of `sc` are scored: h2o all,
        snapkv the prompt's last window (none once past the prompt)."""
        if self.method == "h2o":
            return 0
        seq = sc.seq
        if seq.progress.evicted or sc.start >= seq.num_prompt_tokens:
            return NEVER
        return seq.num_prompt_tokens - self.window

    def annotate(self, plan, scheduled) -> None:
        """Kv-space starts, RoPE offsets and scored rows for `plan`."""
        ev = np.fromiter([sc.seq.progress.evicted for sc in scheduled], np.int32, len(scheduled))
        plan.starts = plan.starts - ev
        plan.pos_offset = ev
        plan.score_from = np.fromiter(
            [self._score_from(sc) for sc in scheduled], np.int32, len(scheduled)
        )

    def after_step(self, scheduled) -> None:
        """Cut every sequence of the step that went over its budget."""
        for sc in scheduled:
            seq = sc.seq
            if seq.finished or seq.request_id not in self.bm:
                continue
            p = seq.progress
            n = p.num_computed - p.evicted  # kv tokens held
            if p.num_reserved != p.num_computed or n < self.budget:
                continue
            if self.method == "snapkv":  # once, in the step the prompt's prefill ends
                if (
                    p.evicted
                    or not sc.start < seq.num_prompt_tokens <= p.num_computed
                    or n <= self.budget
                ):
                    continue
                scores = page_io.read_scores(self.runner, p.page_list())
                src = snapkv_keep(scores, n, self.budget, self.window)
            else:
                scores = page_io.read_scores(self.runner, p.page_list())
                src = h2o_keep(scores, n, self.budget - self.page_size)
            keep = src.shape[-1]
            page_io.compact(self.runner, p.page_list(), src)
            self.bm.compact(seq.request_id, keep)
            self.evicted_tokens += n - keep
            self.cuts += 1

    def metrics(self) -> dict:
        return dict(evicted_tokens=self.evicted_tokens, eviction_cuts=self.cuts)


def make_evictor(config, runner, bm) -> Evictor | None:
    """The engine's Evictor under kv_eviction snapkv / h2o, else None."""
    if config.kv_eviction not in ("snapkv", "h2o"):
        return None
    return Evictor(
        config.kv_eviction, config.kv_budget, config.snapkv_window, config.page_size, runner, bm
    )
