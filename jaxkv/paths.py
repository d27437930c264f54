"""Where jaxkv keeps its files: ``$JAXKV_CACHE`` (default ``~/.cache/jaxkv``)
holds downloads (``downloads/``), converted models (``models/``) and JAX's
persistent compilation cache (``xla/``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$JAXKV_CACHE``, default ``~/.cache/jaxkv``."""
    return Path(os.environ.get("JAXKV_CACHE") or Path.home() / ".cache" / "jaxkv")


def enable_compilation_cache() -> None:
    """Keep compiled step programs across runs in ``$JAXKV_CACHE/xla`` (unless
    the user set JAX's own cache directory), so a second run of the same
    model and engine shape loads its programs instead of compiling them.
    This changes JAX's global configuration, so only the entry points (the
    `jaxkv` command, `LLM`) call it; a program embedding `LLMEngine` decides
    for itself."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    path = cache_dir() / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
