"""A `--model` value -> a ready model: resolve the name or path, read the
checkpoint, build the NNX module (optionally quantized) and the tokenizer."""

from __future__ import annotations

from typing import Any

from checkpoints import load_checkpoint
from checkpoints.known_models import resolve_model_path


def load_model(
    model: str,
    *,
    dtype: str = "float32",
    quantize: str | None = None,
    verify_checksums: bool = True,
    gguf_blocks: bool = False,
) -> tuple[Any, Any]:
    """-> (`jaxkv.model.llama.Llama` in `dtype`, `jaxkv.tokenizer.Tokenizer` or
    None). `model` is a known name (see `checkpoints.known_models`) or a path:
    a Hugging Face folder, a GGUF file or a jaxkv checkpoint (whose tensor
    checksums are checked unless ``verify_checksums=False``). ``gguf_blocks``:
    a GGUF's Q8_0 tied embedding kept as blocks (`jaxkv.model.q8`)."""
    import jax.numpy as jnp

    from jaxkv.model.blocks import BlockWeight
    from jaxkv.model.llama import Llama
    from jaxkv.model.params import check_params
    from jaxkv.model.q8 import Q8Blocks

    if gguf_blocks and quantize is not None:
        raise ValueError(
            f"gguf_blocks and quantize={quantize!r}: a weight is kept in its GGUF "
            "blocks or quantized, not both"
        )

    # Kept in blocks, a known model is read from its GGUF (not the float32 conversion).
    config, params, tokenizer = load_checkpoint(
        resolve_model_path(model, gguf=gguf_blocks),
        verify_checksums=verify_checksums,
        gguf_blocks=gguf_blocks,
    )
    check_params(config, params)
    dt = jnp.dtype(dtype)

    # Each host tensor is dropped as soon as its device copy is made, so the
    # checkpoint and the module are never both whole in memory (SmolLM2's
    # peak RSS while loading: 1.55 GB -> about one copy of the weights).
    def init(name, shape):
        w = params.pop(name)
        return w if isinstance(w, (Q8Blocks, BlockWeight)) else jnp.asarray(w, dt, copy=False)

    module = Llama(config, init, quantize)
    _release_freed_memory()
    return module, tokenizer


def _release_freed_memory() -> None:
    """Give the host memory freed while loading (the checkpoint's copies,
    fused-weight temporaries) back to the OS: glibc keeps freed blocks in
    its heap otherwise (measured: ~250 MB of SmolLM2's load)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
