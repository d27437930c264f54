"""jaxkv's own checkpoint format: a directory

    jaxkv_checkpoint.json   marker + manifest: format, version, checksum algorithm,
                            {name: [shape, dtype, sha256 of the C-order bytes]}
    model_config.json       ModelConfig.to_dict()
    params/                 orbax-checkpoint of the flat params dict (numpy arrays)
    tokenizer/              Tokenizer.to_files() (optional)

Written into a temporary sibling directory and renamed into place, so a crash
mid-save never leaves a directory that looks like a complete checkpoint.

Integrity. Version 2 manifests carry every tensor's sha256 and `restore`
checks each one, refusing a mismatch by tensor name (``verify_checksums=False``
skips the hashing, about 1.5 GB/s per core, for speed). Version 1
checkpoints, written before checksums, still load, unverified, with a
warning; a version 2 manifest that lacks a tensor's checksum is refused, so
the version says whether sums must be there. Before anything is allocated
the manifest is checked against the config (the layer count first) and
against orbax's metadata of the stored arrays: a manifest shape or dtype
the data does not have (bfloat16 over float32 data) is refused by name,
never cast. Every file read must be regular (no FIFO, no device) and the
JSON files are size-bounded (`jaxkv.tokenizer.read_regular_file`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from checkpoints.dtypes import DTYPES, cast_params
from checkpoints.limits import check_layer_count, check_tokenizer_fits
from jaxkv.config import ModelConfig
from jaxkv.model.params import check_params, expected_shapes, shape_problems
from jaxkv.tokenizer import MAX_INDEX_BYTES, Tokenizer, read_json_file

log = logging.getLogger(__name__)

MARKER = "jaxkv_checkpoint.json"
FORMAT_VERSION = 2  # 1: no checksums
CHECKSUM = "sha256"


def is_jaxkv_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / MARKER).is_file()


def is_current(path: str | os.PathLike) -> bool:
    """A jaxkv checkpoint of this format version (one with checksums)."""
    try:
        return is_jaxkv_checkpoint(path) and _read_manifest(Path(path))[0] == FORMAT_VERSION
    except ValueError:
        return False


def save(
    path: str | os.PathLike,
    config: ModelConfig,
    params: Mapping[str, np.ndarray],
    tokenizer: Tokenizer | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Write a jaxkv checkpoint at ``path`` (params keep their dtypes), with
    every tensor's sha256 in the manifest."""
    path = Path(path).absolute()
    check_params(config, params)
    check_tokenizer_fits(config, tokenizer)
    dtypes = {np.dtype(v.dtype) for v in params.values()}
    if not dtypes <= set(DTYPES.values()):
        raise ValueError(
            f"params: unsupported dtypes {sorted(map(str, dtypes - set(DTYPES.values())))}"
        )
    if path.exists() and not overwrite:
        raise ValueError(f"{path}: already exists (pass overwrite=True to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        # np.require, not ascontiguousarray: that makes a 0-d array (a KV scale) 1-d.
        arrays = {k: np.require(v, requirements="C") for k, v in params.items()}
        with _checkpointer() as ckpt:
            ckpt.save(tmp / "params", arrays)
            ckpt.wait_until_finished()
        (tmp / "model_config.json").write_text(json.dumps(config.to_dict(), indent=2))
        if tokenizer is not None:
            tokenizer.to_files(tmp / "tokenizer")
        sums = _digests(arrays)
        manifest = {
            "format": "jaxkv",
            "version": FORMAT_VERSION,
            "checksum": CHECKSUM,
            "tensors": {
                k: [list(v.shape), str(v.dtype), sums[k]] for k, v in sorted(arrays.items())
            },
        }
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


def restore(
    path: str | os.PathLike, *, dtype: str | np.dtype | None = None, verify_checksums: bool = True
) -> tuple[ModelConfig, dict[str, np.ndarray], Tokenizer | None]:
    """Read a jaxkv checkpoint. ``dtype=None`` keeps the stored dtypes;
    ``verify_checksums=False`` skips hashing the tensors (see the module
    docstring). Raises ValueError naming the file or tensor at fault."""
    path = Path(path).absolute()
    version, entries = _read_manifest(path)
    config = read_config(path)
    try:
        check_layer_count(config.num_layers, entries, "layers.", "num_layers")
    except ValueError as e:
        raise ValueError(f"{path / 'model_config.json'}: {e}") from None
    problems = shape_problems(expected_shapes(config), {k: e[0] for k, e in entries.items()})
    if problems:
        raise ValueError(
            f"{path}: manifest does not match model_config.json: " + "; ".join(problems)
        )
    _check_files(path / "params")
    stored = _stored_arrays(path / "params")
    if only := sorted(set(stored) ^ set(entries)):
        raise ValueError(f"{path}: tensors in only one of the manifest and params/: {only[:5]}")
    target = {}
    for k, (shape, dt, _) in sorted(entries.items()):
        if stored[k][1] != dt:
            raise ValueError(
                f"{path}: tensor {k!r}: manifest says {dt}, the data is {stored[k][1]}"
            )
        if stored[k][0] != shape:
            raise ValueError(
                f"{path}: tensor {k!r}: manifest says shape {list(shape)}, the data has "
                f"{list(stored[k][0])}"
            )
        try:
            target[k] = np.empty(shape, DTYPES[dt])
        except (MemoryError, ValueError) as e:
            raise ValueError(
                f"{path}: tensor {k!r}: cannot allocate {dt} {list(shape)} ({e})"
            ) from None
    try:
        with _checkpointer() as ckpt:
            params = {k: np.asarray(v) for k, v in ckpt.restore(path / "params", target).items()}
    except Exception as e:  # orbax/tensorstore raise many types for damaged data
        raise ValueError(
            f"{path / 'params'}: cannot restore arrays ({type(e).__name__}: {e})"
        ) from None
    for k, v in params.items():
        if v.shape != target[k].shape or v.dtype != target[k].dtype:
            raise ValueError(
                f"{path}: tensor {k!r} restored as {v.shape} {v.dtype}, "
                f"manifest says {target[k].shape} {target[k].dtype}"
            )
    if version < 2:
        log.warning(
            "%s: jaxkv checkpoint version %d has no checksums: its tensors are loaded "
            "unverified (convert it again to add them)",
            path,
            version,
        )
    elif verify_checksums:
        found = _digests(params)
        bad = [
            f"tensor {k!r}: checksum mismatch (manifest {CHECKSUM} {entries[k][2]}, data {found[k]})"
            for k in sorted(params)
            if found[k] != entries[k][2]
        ]
        if bad:
            raise ValueError(
                f"{path}: "
                + "; ".join(bad[:4])
                + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
            )
    if dtype is not None:
        params = cast_params(params, dtype)
    tok_dir = path / "tokenizer"
    tokenizer = Tokenizer.from_files(tok_dir) if tok_dir.is_dir() else None
    try:
        check_tokenizer_fits(config, tokenizer)
    except ValueError as e:
        raise ValueError(f"{tok_dir}: {e}") from None
    return config, params, tokenizer


def read_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig of the jaxkv checkpoint at ``path`` (model_config.json)."""
    path = Path(path).absolute()
    d = _read_part(path, "model_config.json")
    try:
        return ModelConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path / 'model_config.json'}: {e}") from None


def _read_part(path: Path, name: str) -> dict:
    f = path / name
    if not os.path.lexists(f):
        raise ValueError(f"{path}: not a complete jaxkv checkpoint (missing {f})")
    try:
        return read_json_file(f)
    except ValueError as e:
        raise ValueError(f"{path}: corrupt jaxkv checkpoint ({e})") from None


def _read_manifest(path: Path) -> tuple[int, dict[str, tuple[tuple[int, ...], str, str | None]]]:
    """(version, {name: (shape, dtype, sha256 or None)}), every entry checked."""
    m = _read_part(path, MARKER)
    marker = path / MARKER
    if m.get("format") != "jaxkv" or not isinstance(m.get("tensors"), dict):
        raise ValueError(f"{path}: corrupt jaxkv checkpoint ({marker} is not a jaxkv manifest)")
    version = m.get("version")
    if isinstance(version, bool) or version not in (1, FORMAT_VERSION):
        raise ValueError(f"{path}: unsupported jaxkv checkpoint version {version!r}")
    if version >= 2 and m.get("checksum") != CHECKSUM:
        raise ValueError(f"{marker}: checksum: must be {CHECKSUM!r}, got {m.get('checksum')!r}")
    entries = {}
    for k, e in m["tensors"].items():
        shape, dt, digest = (
            (*e, None)[:3] if isinstance(e, list) and len(e) in (2, 3) else (None,) * 3
        )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(
                f"{marker}: tensor {k!r}: bad entry {str(e)[:80]} (want [shape, dtype, {CHECKSUM}])"
            )
        if dt not in DTYPES:
            raise ValueError(
                f"{marker}: tensor {k!r}: unsupported dtype {dt!r}; supported: {sorted(DTYPES)}"
            )
        if digest is None and version >= 2:
            raise ValueError(
                f"{marker}: tensor {k!r}: no checksum (a version {version} manifest has "
                "one for every tensor)"
            )
        if digest is not None and not (
            isinstance(digest, str) and re.fullmatch("[0-9a-f]{64}", digest)
        ):
            raise ValueError(f"{marker}: tensor {k!r}: bad {CHECKSUM} {str(digest)[:80]}")
        entries[k] = (tuple(shape), dt, digest)
    return version, entries


def _check_files(params: Path) -> None:
    """Refuse anything under params/ orbax could hang or drown on: FIFOs,
    devices, links to directories (not followed, so not checked), and
    metadata files beyond MAX_INDEX_BYTES."""
    if not params.is_dir():
        raise ValueError(f"{params.parent}: not a complete jaxkv checkpoint (missing {params})")
    for root, dirs, files in os.walk(params):
        for name in dirs + files:
            f = Path(root) / name
            if name in dirs and f.is_symlink():
                raise ValueError(f"{f}: a link to a directory; jaxkv checkpoints have none")
            try:
                st = os.stat(f)
            except OSError as e:
                raise ValueError(f"{f}: cannot read ({e.strerror or e})") from None
            if name in files and not stat.S_ISREG(st.st_mode):
                raise ValueError(
                    f"{f}: not a regular file; refusing to read it (orbax would block "
                    "on a FIFO and read a device without end)"
                )
            if name.startswith("_") and st.st_size > MAX_INDEX_BYTES:
                raise ValueError(
                    f"{f}: {st.st_size} bytes, larger than the {MAX_INDEX_BYTES >> 20} MiB limit"
                )


def _stored_arrays(params: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of the arrays orbax stored (its metadata only)."""
    try:
        with _checkpointer() as ckpt:
            meta = ckpt.metadata(params)
        tree = getattr(getattr(meta, "item_metadata", meta), "tree", None)
        return {
            k: (tuple(int(d) for d in m.shape), str(np.dtype(m.dtype))) for k, m in tree.items()
        }
    except Exception as e:  # orbax raises many types for damaged metadata
        raise ValueError(
            f"{params}: cannot read the stored arrays' metadata ({type(e).__name__}: {e})"
        ) from None


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest()


def _digests(arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """sha256 of each array's bytes, hashed in threads (hashlib drops the GIL)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(arrays, pool.map(_digest, arrays.values())))


def _checkpointer():
    """orbax's checkpointer (imported here: half a second that a start from a
    GGUF or Hugging Face checkpoint never needs)."""
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()
