"""Checkpoint loading and conversion: Hugging Face safetensors dirs, GGUF files
and jaxkv's own orbax-checkpoint format. Every loader returns
``(config, params)`` with params as described in `jaxkv.model.params`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from checkpoints.gguf_io import is_gguf, load_gguf
from checkpoints.jaxkv_format import MARKER, is_jaxkv_checkpoint, restore, save
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
    import json

    from checkpoints.gguf_io import read_gguf_metadata
    from checkpoints.safetensors_io import read_hf_config
    from checkpoints.model_config import from_gguf_metadata

    kind = detect_kind(path)
    if kind == "jaxkv":
        return ModelConfig.from_dict(json.loads((Path(path) / "model_config.json").read_text()))
    if kind == "hf":
        return read_hf_config(path)
    return from_gguf_metadata(read_gguf_metadata(path))


def load_checkpoint(path: str | os.PathLike, *, dtype: str | np.dtype | None = None,
                    progress: bool = False) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """Load any supported checkpoint as (config, params, tokenizer or None).

    ``dtype=None`` gives float32 for HF and GGUF sources and the stored dtype for
    jaxkv checkpoints. The tokenizer is None only for an HF dir without
    tokenizer.json or a jaxkv checkpoint saved without one."""
    kind = detect_kind(path)
    if kind == "jaxkv":
        return restore(path, dtype=dtype)
    if kind == "hf":
        config, params = load_hf_dir(path, dtype=dtype, progress=progress)
        tok = Tokenizer.from_hf_dir(path) if (Path(path) / "tokenizer.json").is_file() else None
        return config, params, tok
    config, params, info = load_gguf(path, dtype=dtype, progress=progress)
    return config, params, tokenizer_from_gguf(info)
