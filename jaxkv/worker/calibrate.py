"""fp8 KV scales, calibrated once at engine start on a fixed text.

An fp8 cache's scales (one per KV head and layer, `jaxkv.model.kv_cache`)
are set by the first step that writes a live token into them and are fixed
from then on. Left to the first request, a request's tokens would depend on
which prompts happened to share the engine's first step; so the engine
runs that first write itself, on `CALIBRATION_TEXT` (or, without a
tokenizer, fixed pseudo-random token ids), through the runner's K/V-only
program into free pages that no sequence owns yet. (vLLM likewise derives
its calculated KV scales from a forward pass of its own.) Outputs are then
the same whatever arrives first, and a lone run is an oracle for a batched
one. Several processes: the leader's call is mirrored to the followers.
"""

from __future__ import annotations

import numpy as np

from jaxkv.worker.scoring import plan_for

CALIBRATION_TEXT = (
    "A key-value cache keeps the keys and values of every token a model has read, so that "
    "each new token computes only its own. The quick brown fox jumps over the lazy dog. "
    "1, 2, 3, 5, 8, 13, 21, 34. def add(a, b):\n    return a + b\n"
    "Paris is the capital of France; Tokyo is the capital of Japan."
)


def calibration_tokens(tokenizer, vocab_size: int, limit: int) -> list[int]:
    """The calibration prompt's token ids, at most `limit` of them."""
    if tokenizer is not None:
        ids = list(tokenizer.encode(CALIBRATION_TEXT))
    else:
        ids = [int(t) for t in np.random.default_rng(0).integers(1, vocab_size, 96)]
    return ids[:limit]


def calibrate_kv_scales(runner, tokenizer, vocab_size: int, config, ring: int) -> bool:
    """Set an fp8 cache's scales (a no-op for other caches); `config` the
    engine's (page size, step token budget), `ring` its hybrid pool's ring
    pages (0: none). Returns whether a calibration step ran."""
    cache = runner.cache
    if cache.k_scale is None or cache.k_scale[0].ndim != 1:
        return False
    page_size = cache.page_size
    n = min(config.max_num_batched_tokens, (cache.num_pages - 1) * page_size)
    ids = calibration_tokens(tokenizer, vocab_size, n)
    pages = list(range(1, 1 + -(-len(ids) // page_size)))
    plan = plan_for([(ids, 0, pages)])
    if ring:  # a hybrid pool's sliding layers: the first seat's ring
        plan.ring_base = np.ones(1, np.int32)
    runner.forward(plan)
    return True
