"""A `--model` value -> a ready model: resolve the name or path, read the
checkpoint, build the NNX module (optionally quantized) and the tokenizer."""

from __future__ import annotations

from typing import Any

from checkpoints import load_checkpoint
from checkpoints.known_models import resolve_model_path


def load_model(model: str, *, dtype: str = "float32", quantize: str | None = None
               ) -> tuple[Any, Any]:
    """-> (`jaxkv.model.llama.Llama` in `dtype`, `jaxkv.tokenizer.Tokenizer` or
    None). `model` is a known name (see `checkpoints.known_models`) or a path:
    a Hugging Face folder, a GGUF file or a jaxkv checkpoint."""
    import jax.numpy as jnp

    from jaxkv.model.llama import Llama

    config, params, tokenizer = load_checkpoint(resolve_model_path(model))
    module = Llama.from_params(config, params, dtype=jnp.dtype(dtype), quantize=quantize)
    return module, tokenizer
