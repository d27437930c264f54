"""Where jaxkv keeps its files: ``$JAXKV_CACHE`` (default ``~/.cache/jaxkv``)
holds downloads (``downloads/``), converted models (``models/``), compiled
step programs (``programs/``, `jaxkv.worker.program_store`), native CPU
kernels (``native/``) and JAX's persistent compilation cache (``xla/``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$JAXKV_CACHE``, default ``~/.cache/jaxkv``."""
    return Path(os.environ.get("JAXKV_CACHE") or Path.home() / ".cache" / "jaxkv")


def uses_program_store(engine_options: dict) -> bool:
    """Whether an engine of these options keeps its compiled programs in
    jaxkv's own store (`program_cache`, on one device of one process)."""
    procs = engine_options.get("num_processes") or os.environ.get("JAXKV_NUM_PROCESSES") or 1
    return (engine_options.get("program_cache", True) is not False
            and (engine_options.get("tensor_parallel_size") or 1) == 1 and int(procs) <= 1)


def enable_compilation_cache() -> None:
    """Keep compiled step programs across runs in ``$JAXKV_CACHE/xla`` (unless
    the user set JAX's own cache directory), so a second run of the same
    model and engine shape loads its programs instead of compiling them.
    This changes JAX's global configuration, so only the entry points (the
    `jaxkv` command, `LLM`) call it, and only for engines that do not use
    jaxkv's program store (which skips tracing too, and does not store a
    program JAX's cache gave back); a program embedding `LLMEngine`
    decides for itself."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    path = cache_dir() / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
