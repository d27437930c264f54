"""Checkpoint loading and conversion: Hugging Face safetensors dirs, GGUF files
and jaxkv's own orbax-checkpoint format. Every loader returns
``(config, params)`` with params as described in `jaxkv.model.params`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from checkpoints.gguf_io import is_gguf, load_gguf
from checkpoints.gguf_tokenizer import tokenizer_from_gguf
from checkpoints.jaxkv_format import MARKER, is_jaxkv_checkpoint, read_config, restore, save
from checkpoints.limits import check_tokenizer_fits
from checkpoints.safetensors_io import load_hf_dir
from jaxkv.config import ModelConfig
from jaxkv.model.params import check_params, expected_shapes
from jaxkv.tokenizer import Tokenizer

__all__ = [
    "check_params",
    "detect_kind",
    "expected_shapes",
    "load_checkpoint",
    "load_config",
    "load_gguf",
    "load_hf_dir",
    "restore",
    "save",
]


def detect_kind(path: str | os.PathLike) -> str:
    """ "jaxkv", "hf" or "gguf"; ValueError when ``path`` is none of them."""
    p = Path(path)
    if p.is_dir():
        if is_jaxkv_checkpoint(p):
            return "jaxkv"
        weights = [p / "model.safetensors", p / "model.safetensors.index.json"]
        if os.path.lexists(p / "config.json") and any(map(os.path.lexists, weights)):
            for f in [p / "config.json"] + weights:  # a FIFO or device named, not taken for absent
                if os.path.lexists(f) and not f.is_file():
                    raise ValueError(f"{f}: not a regular file ({_what(f)}); refusing to read it")
            return "hf"
        raise ValueError(
            f"{p}: directory is neither a jaxkv checkpoint ({MARKER}) "
            "nor a Hugging Face dir (config.json + model.safetensors[.index.json])"
        )
    if is_gguf(p):
        return "gguf"
    if not p.exists():
        raise ValueError(f"{p}: no such file or directory")
    raise ValueError(f"{p}: not a GGUF file (no .gguf suffix, no GGUF magic)")


def _what(path: Path) -> str:
    """What a non-regular file is, in words."""
    from jaxkv.tokenizer import _file_kind

    try:
        return _file_kind(path.stat().st_mode)
    except OSError:
        return "a dangling link"


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Only the ModelConfig of a checkpoint (no weights are read)."""
    from checkpoints.gguf_config import from_gguf_metadata
    from checkpoints.gguf_io import read_gguf_metadata
    from checkpoints.safetensors_io import read_hf_config

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


def load_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: str | np.dtype | None = None,
    progress: bool = False,
    verify_checksums: bool = True,
    gguf_blocks: bool = False,
) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """Load any supported checkpoint as (config, params, tokenizer or None).

    ``dtype=None`` gives float32 for HF and GGUF sources and the stored dtype for
    jaxkv checkpoints. The tokenizer is None only for an HF dir without
    tokenizer.json or a jaxkv checkpoint saved without one; one with ids
    beyond the model's vocab_size is refused. ``verify_checksums=False``
    skips hashing a jaxkv checkpoint's tensors (`restore`); HF and GGUF
    files carry no checksums. ``gguf_blocks``: a GGUF's Q8_0 tied embedding
    stays as blocks (`load_gguf`'s keep_blocks)."""
    kind = detect_kind(path)
    if kind == "jaxkv":
        return restore(path, dtype=dtype, verify_checksums=verify_checksums)
    if kind == "hf":
        # The side files first (lexists: a tokenizer.json that is a FIFO, a
        # device or a dangling link is an error), so a bad one is refused
        # before gigabytes of tensors are read.
        tok = (
            Tokenizer.from_hf_dir(path) if os.path.lexists(Path(path) / "tokenizer.json") else None
        )
        config, params = load_hf_dir(path, dtype=dtype, progress=progress)
    else:
        config, params, info = load_gguf(
            path, dtype=dtype, progress=progress, keep_blocks=gguf_blocks
        )
        try:
            tok = tokenizer_from_gguf(info)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    try:
        check_tokenizer_fits(config, tok)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return config, params, tok
