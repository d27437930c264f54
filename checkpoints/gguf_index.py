"""A GGUF file's parsed index kept in jaxkv's cache, so a second start does
not parse the file again.

The `gguf` library's reader parses every key and tensor header when it
opens a file: for SmolLM2's 49,152-token vocabulary and its merges that is
about 2.6 s on a 2-core VM, most of a warm `jaxkv generate`. The first
open parses with it as usual and writes what it found (the key/values and
each tensor's name, type, shape and byte range) as JSON under
``$JAXKV_CACHE/gguf/`` (when that folder is private, `jaxkv.paths`); later
opens of the same file (same path, size, modification time and inode) read
that and map the tensors straight from the file (`numpy.memmap`, the
reader's own way). An index that does not parse, or names bytes beyond the
file, is ignored and written again."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("jaxkv")
VERSION = 1


@dataclasses.dataclass
class IndexedTensor:
    """A tensor of a GGUF file as the reader gives it: its name, GGML type,
    shape (GGUF order), element count, byte offset, and `data` (the raw
    items, mapped from the file on first use)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    data_offset: int
    dtype: str
    data_shape: tuple[int, ...]
    path: str

    @property
    def data(self) -> np.ndarray:
        return np.memmap(
            self.path,
            dtype=np.dtype(self.dtype),
            mode="r",
            offset=self.data_offset,
            shape=self.data_shape,
        )


def _key(path: Path) -> str:
    """The file's identity: path, size, time, inode, and a digest of its
    first MiB (where the key/values begin) and last 64 KiB, so a file
    rewritten in place within one clock tick is not taken for the old."""
    import gguf

    st = os.stat(path)
    h = hashlib.sha256(
        f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{VERSION}|"
        f"{getattr(gguf, '__version__', '')}".encode()
    )
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, st.st_size - (64 << 10)))
        h.update(f.read())
    return h.hexdigest()


def _folder() -> Path | None:
    from jaxkv.paths import private_cache

    return private_cache("gguf", "GGUF files are parsed at every start")


def load(path: Path) -> tuple[dict[str, Any], list[IndexedTensor]] | None:
    """(the key/values, the tensors) of `path` from its index, or None."""
    folder = _folder()
    if folder is None:
        return None
    index = folder / f"{_key(path)[:32]}.json"
    try:
        data = json.loads(index.read_text())
        size = os.stat(path).st_size
        tensors = [_tensor(t, str(path), size) for t in data["tensors"]]
        return data["meta"], tensors
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("jaxkv: GGUF index %s unreadable (%s); parsing the file", index, e)
        return None


def _tensor(t: dict, path: str, size: int) -> IndexedTensor:
    from gguf import GGMLQuantizationType

    shape = tuple(int(x) for x in t["data_shape"])
    nbytes = int(np.prod(shape)) * np.dtype(t["dtype"]).itemsize
    if t["data_offset"] < 0 or t["data_offset"] + nbytes > size:
        raise ValueError(f"tensor {t['name']!r} lies beyond the file")
    return IndexedTensor(
        t["name"],
        GGMLQuantizationType(t["tensor_type"]),
        np.asarray(t["shape"], np.uint64),
        int(t["n_elements"]),
        int(t["data_offset"]),
        t["dtype"],
        shape,
        path,
    )


def save(path: Path, meta: dict[str, Any], tensors) -> None:
    """Keep the index of `path` (the reader's `tensors`) for the next open;
    a cache that cannot be written is only slower."""
    folder = _folder()
    if folder is None:
        return
    rows = [
        dict(
            name=t.name,
            tensor_type=int(t.tensor_type),
            shape=[int(x) for x in t.shape],
            n_elements=int(t.n_elements),
            data_offset=int(t.data_offset),
            dtype=t.data.dtype.str,
            data_shape=[int(x) for x in t.data.shape],
        )
        for t in tensors
    ]
    try:
        text = json.dumps({"meta": meta, "tensors": rows}, default=_plain)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, folder / f"{_key(path)[:32]}.json")
    except (OSError, TypeError, ValueError) as e:
        log.warning("jaxkv: cannot keep the GGUF index of %s (%s)", path, e)


def _plain(v):
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"{type(v).__name__} is not JSON")
