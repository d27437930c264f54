"""The engine's KV pool sizing: how many pages an engine's pool gets
(`plan_num_pages`: asked for, or sized from what the device or host has
free) and the longest sequence it takes (`max_model_len`), from the size
formula of `jaxkv.model.memory`."""

from __future__ import annotations

import dataclasses

from jaxkv.model.memory import kv_cache_bytes, pages_for_budget


def engine_pool(config, model, mesh=None):
    """(CacheConfig, AttentionSpec, max_model_len) of an engine with
    `config` (EngineConfig) over `model` (ModelConfig): the pool's pages
    (`plan_num_pages`), a hybrid pool's rings (`hybrid_plan`), the
    attention choice and the longest sequence the pool takes."""
    from jaxkv.config import CacheConfig
    from jaxkv.model.attention import AttentionSpec

    kv_dtype = config.kv_dtype or config.dtype
    num_pages = plan_num_pages(config, model, kv_dtype, config.tensor_parallel_size)
    # A hybrid pool: the sliding layers' rings per seat (jaxkv.core.scheduling.seats).
    local, ring, local_pages = hybrid_plan(config, model)
    cache = CacheConfig(
        num_pages=num_pages,
        page_size=config.page_size,
        kv_dtype=kv_dtype,
        local_pages=local_pages,
        scores=config.kv_eviction in ("snapkv", "h2o"),
    )
    attention = dataclasses.replace(
        AttentionSpec.for_engine(model, config, mesh), ring_pages=ring, local_layers=local
    )
    return (
        cache,
        attention,
        max_model_len(config, model, attention, (num_pages - 1) * config.page_size),
    )


def _free_device_memory() -> int | None:
    """The least free memory of this process's devices (None if they do not say)."""
    import jax

    free = []
    for dev in jax.local_devices():
        try:
            stats = dev.memory_stats()
        except Exception:  # noqa: BLE001 - CPU backends may not report
            return None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    return min(free) if free else None


HOST_POOL_MAX = 1 << 30  # the largest pool sized without being asked, where devices say nothing


def host_available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def hybrid_plan(config, model_config) -> tuple[tuple[int, ...], int, int]:
    """A hybrid pool (`jaxkv.core.scheduling.seats`): (the sliding layers, pages per
    sequence's ring, the local pool's pages), or ((), 0, 0) where it does
    not apply: turned off, streaming eviction, or a model whose layers do
    not mix global layers with one sliding window."""
    from jaxkv.model.attention import ring_pages

    windows = model_config.windows
    slide = {w for w in windows if w is not None}
    if not config.hybrid_kv_cache or config.kv_eviction or len(slide) != 1 or None not in windows:
        return (), 0, 0
    ring = ring_pages(slide.pop(), config.max_num_batched_tokens, config.page_size)
    return (
        tuple(i for i, w in enumerate(windows) if w is not None),
        ring,
        1 + config.max_num_seqs * ring,
    )


def plan_num_pages(config, model_config, kv_dtype: str, shards: int = 1) -> int:
    """The pool size of an engine: EngineConfig.num_pages if set, else what
    kv_cache_memory holds, else gpu_memory_utilization of the device's free
    memory where the device reports it. On CPU (it does not) the pool holds
    what the run can use, max_num_seqs sequences of max_model_len tokens
    (the model's context when not set), but at most gpu_memory_utilization
    of the host's available memory and `HOST_POOL_MAX`. Budgets are per
    device: with the KV heads split over `shards` devices (the model's KV
    heads as stored, replicas included), each holds num_kv_heads / shards
    of every page."""
    c, m = config, model_config
    if c.num_pages is not None:
        return c.num_pages
    local, _, local_pages = hybrid_plan(c, m)  # its rings first; the global layers page the rest
    reserved = (
        kv_cache_bytes(
            len(local),
            m.num_kv_heads // shards,
            m.head_dim,
            c.page_size,
            local_pages,
            dtype=kv_dtype,
        )
        if local
        else 0
    )
    m = dataclasses.replace(m, num_layers=m.num_layers - len(local), layer_types=()) if local else m
    geom = (m.num_layers, m.num_kv_heads // shards, m.head_dim)
    budget = None if c.kv_cache_memory is None else c.kv_cache_memory - reserved
    if budget is None:
        free = _free_device_memory()
        if free:
            budget = int(free * c.gpu_memory_utilization) - reserved
        else:
            page = kv_cache_bytes(*geom, c.page_size, dtype=kv_dtype)
            max_len = min(c.max_model_len or m.max_position_embeddings, m.max_position_embeddings)
            want = (c.max_num_seqs * -(-max_len // c.page_size) + 1) * page  # + trash page
            avail = host_available_memory()
            cap = (
                HOST_POOL_MAX
                if avail is None
                else min(HOST_POOL_MAX, int(avail * c.gpu_memory_utilization))
            )
            budget = max(min(want, cap), 2 * page)
    pages = pages_for_budget(budget, *geom, c.page_size, kv_dtype)
    if pages < 2:
        rings = f" beside {reserved} bytes of sliding-layer rings (hybrid pool)" if reserved else ""
        raise ValueError(
            f"kv_cache_memory: {max(budget, 0)} bytes hold fewer than 2 KV pages{rings}"
        )
    return int(pages)


def max_model_len(config, model_config, attention, pool_tokens: int) -> int:
    """The longest sequence an engine takes: EngineConfig.max_model_len
    capped by the model's positions, and by the pool unless a sliding
    window releases pages as the sequence runs (then the pool must hold one
    window)."""
    max_pos = model_config.max_position_embeddings
    n = min(config.max_model_len or max_pos, max_pos)
    window, sinks = attention.sliding_window, attention.num_sink_tokens
    if window is None:
        return min(n, pool_tokens)
    if window + sinks + 2 * config.page_size > pool_tokens:
        raise ValueError(
            f"num_pages: the pool ({pool_tokens} tokens) cannot hold one "
            f"attention window of {window} tokens"
        )
    return n
