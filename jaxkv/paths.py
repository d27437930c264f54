"""Where jaxkv keeps its files: ``$JAXKV_CACHE`` (default ``~/.cache/jaxkv``)
holds downloads (``downloads/``), converted models (``models/``), compiled
step programs (``programs/``, `jaxkv.worker.program_store`), native CPU
kernels (``native/``) and JAX's persistent compilation cache (``xla/``).

The last three hold code this process will run, so they are used only when
private to the user (`private_cache`; `pallas_kernels.private_dirs` says
what counts)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("jaxkv")
_WARNED: set[str] = set()


def cache_dir() -> Path:
    """``$JAXKV_CACHE``, default ``~/.cache/jaxkv``."""
    return Path(os.environ.get("JAXKV_CACHE") or Path.home() / ".cache" / "jaxkv")


def private_cache(sub: str, instead: str) -> Path | None:
    """``cache_dir() / sub``, made if absent, when no other user can write
    it; else None, with a warning (once) naming the folder, why, and what
    happens `instead`."""
    from pallas_kernels import private_dirs

    path = cache_dir() / sub
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        why = f"{path} cannot be made ({e.strerror or e})"
    else:  # the cache folder itself too: a shared cache is refused, sticky or not
        why = private_dirs.problem(path) or private_dirs.problem(path.parent)
    if why is None:
        return path
    if sub not in _WARNED:
        _WARNED.add(sub)
        log.warning(
            "jaxkv: not using the cache folder %s: %s; %s (make it private, e.g. "
            "chmod 700, or set JAXKV_CACHE to a folder of your own)",
            path,
            why,
            instead,
        )
    return None


def uses_program_store(engine_options: dict) -> bool:
    """Whether an engine of these options keeps its compiled programs in
    jaxkv's own store (`program_cache`, on one device of one process)."""
    procs = engine_options.get("num_processes") or os.environ.get("JAXKV_NUM_PROCESSES") or 1
    return (
        engine_options.get("program_cache", True) is not False
        and (engine_options.get("tensor_parallel_size") or 1) == 1
        and int(procs) <= 1
    )


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
    path = private_cache("xla", "JAX's compilation cache stays off")
    if path is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
