"""jaxkv's own checkpoint format: a directory

    jaxkv_checkpoint.json   marker + manifest: format version, {name: [shape, dtype]}
    model_config.json       ModelConfig.to_dict()
    params/                 orbax-checkpoint of the flat params dict (numpy arrays)
    tokenizer/              Tokenizer.to_files() (optional)

Written into a temporary sibling directory and renamed into place, so a crash
mid-save never leaves a directory that looks like a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np
import orbax.checkpoint as ocp

from checkpoints.dtypes import DTYPES, cast_params
from jaxkv.config import ModelConfig
from jaxkv.model.params import check_params
from jaxkv.tokenizer import Tokenizer

MARKER = "jaxkv_checkpoint.json"
FORMAT_VERSION = 1


def is_jaxkv_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


def save(path: str | os.PathLike, config: ModelConfig, params: Mapping[str, np.ndarray],
         tokenizer: Tokenizer | None = None, *, overwrite: bool = False) -> Path:
    """Write a jaxkv checkpoint at ``path`` (params keep their dtypes)."""
    path = Path(path).absolute()
    check_params(config, params)
    dtypes = {np.dtype(v.dtype) for v in params.values()}
    if not dtypes <= set(DTYPES.values()):
        raise ValueError(f"params: unsupported dtypes {sorted(map(str, dtypes - set(DTYPES.values())))}")
    if path.exists() and not overwrite:
        raise ValueError(f"{path}: already exists (pass overwrite=True to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        arrays = {k: np.ascontiguousarray(v) for k, v in params.items()}
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp / "params", arrays)
            ckpt.wait_until_finished()
        (tmp / "model_config.json").write_text(json.dumps(config.to_dict(), indent=2))
        if tokenizer is not None:
            tokenizer.to_files(tmp / "tokenizer")
        manifest = {"format": "jaxkv", "version": FORMAT_VERSION,
                    "tensors": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(arrays.items())}}
        (tmp / MARKER).write_text(json.dumps(manifest, indent=1))
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / "x")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def restore(path: str | os.PathLike, *, dtype: str | np.dtype | None = None
            ) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """Read a jaxkv checkpoint. ``dtype=None`` keeps the stored dtypes."""
    path = Path(path).absolute()
    try:
        manifest = json.loads((path / MARKER).read_text())
        config = ModelConfig.from_dict(json.loads((path / "model_config.json").read_text()))
        tensors = manifest["tensors"]
        if manifest.get("format") != "jaxkv" or not isinstance(tensors, dict):
            raise ValueError("not a jaxkv manifest")
        target = {k: np.empty(tuple(shape), dtype=np.dtype(DTYPES[dt] if dt in DTYPES else dt))
                  for k, (shape, dt) in tensors.items()}
    except FileNotFoundError as e:
        raise ValueError(f"{path}: not a complete jaxkv checkpoint (missing {e.filename})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: corrupt jaxkv checkpoint ({type(e).__name__}: {e})") from None
    if manifest.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported jaxkv checkpoint version {manifest.get('version')!r}")
    try:
        check_params(config, target)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = dict(ckpt.restore(path / "params", target))
    except Exception as e:  # orbax/tensorstore raise many types for damaged data
        raise ValueError(f"{path / 'params'}: cannot restore arrays ({type(e).__name__}: {e})") from None
    for k, v in params.items():
        if tuple(v.shape) != target[k].shape or v.dtype != target[k].dtype:
            raise ValueError(f"{path}: tensor {k!r} restored as {v.shape} {v.dtype}, "
                             f"manifest says {target[k].shape} {target[k].dtype}")
    params = {k: np.asarray(v) for k, v in params.items()}
    if dtype is not None:
        params = cast_params(params, dtype)
    tok_dir = path / "tokenizer"
    tokenizer = Tokenizer.from_files(tok_dir) if tok_dir.is_dir() else None
    return config, params, tokenizer
