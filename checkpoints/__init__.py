"""Checkpoint loading and conversion: Hugging Face safetensors dirs, GGUF files
and jaxkv's own orbax-checkpoint format. Every loader returns
``(config, params)`` with params as described in `jaxkv.model.params`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from checkpoints.gguf_io import is_gguf, load_gguf
from checkpoints.jaxkv_format import MARKER, is_jaxkv_checkpoint, read_config, restore, save
from checkpoints.limits import check_tokenizer_fits
from checkpoints.safetensors_io import load_hf_dir
from checkpoints.gguf_tokenizer import tokenizer_from_gguf
from jaxkv.config import ModelConfig
from jaxkv.model.params import check_params, expected_shapes
from jaxkv.tokenizer import Tokenizer

__all__ = ["check_params", "detect_kind", "expected_shapes", "load_checkpoint", "load_config", "load_gguf",
           "load_hf_dir", "restore", "save"]


def detect_kind(path: str | os.PathLike) -> str:
    """"jaxkv", "hf" or "gguf"; ValueError when ``path`` is none of them."""
    p = Path(path)
    if p.is_dir():
        if is_jaxkv_checkpoint(p):
            return "jaxkv"
        if (p / "config.json").is_file() and ((p / "model.safetensors").is_file()
                                              or (p / "model.safetensors.index.json").is_file()):
            return "hf"
        raise ValueError(f"{p}: directory is neither a jaxkv checkpoint ({MARKER}) "
                         "nor a Hugging Face dir (config.json + model.safetensors[.index.json])")
    if is_gguf(p):
        return "gguf"
    if not p.exists():
        raise ValueError(f"{p}: no such file or directory")
    raise ValueError(f"{p}: not a GGUF file (no .gguf suffix, no GGUF magic)")


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Only the ModelConfig of a checkpoint (no weights are read)."""
    from checkpoints.gguf_io import read_gguf_metadata
    from checkpoints.safetensors_io import read_hf_config
    from checkpoints.model_config import from_gguf_metadata

    kind = detect_kind(path)
    if kind == "jaxkv":
        return read_config(path)
    if kind == "hf":
        return read_hf_config(path)
    meta = read_gguf_metadata(path)
    try:
        return from_gguf_metadata(meta)
    except ValueError as e:
        raise ValueError(f"{path}: bad GGUF metadata: {e}") from None


def load_checkpoint(path: str | os.PathLike, *, dtype: str | np.dtype | None = None,
                    progress: bool = False, verify_checksums: bool = True,
                    ) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """Load any supported checkpoint as (config, params, tokenizer or None).

    ``dtype=None`` gives float32 for HF and GGUF sources and the stored dtype for
    jaxkv checkpoints. The tokenizer is None only for an HF dir without
    tokenizer.json or a jaxkv checkpoint saved without one; one with ids
    beyond the model's vocab_size is refused. ``verify_checksums=False``
    skips hashing a jaxkv checkpoint's tensors (`restore`); HF and GGUF
    files carry no checksums."""
    kind = detect_kind(path)
    if kind == "jaxkv":
        return restore(path, dtype=dtype, verify_checksums=verify_checksums)
    if kind == "hf":
        config, params = load_hf_dir(path, dtype=dtype, progress=progress)
        # lexists: a tokenizer.json that is a FIFO, a device or a dangling link is an error.
        tok = Tokenizer.from_hf_dir(path) if os.path.lexists(Path(path) / "tokenizer.json") else None
    else:
        config, params, info = load_gguf(path, dtype=dtype, progress=progress)
        try:
            tok = tokenizer_from_gguf(info)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    try:
        check_tokenizer_fits(config, tok)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return config, params, tok
