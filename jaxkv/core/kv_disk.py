"""The disk tier of the KV offload (`jaxkv.core.kv_tiers`): pages the host
tier drops, one file each, found again by a restarted engine.

Layout: ``<kv_offload_dir>/<fingerprint>/<page hash>.kvpage``. The
fingerprint (`fingerprint`) names the model (its config and a digest of its
weights), the cache layout (KV dtype, page size, each paged leaf's shape and
dtype) and fp8's scales, so a file is only ever found by an engine whose
pages it fits. A file is a header (magic, fingerprint, payload length), the
page's arrays as raw bytes, and a blake2b checksum of both; one that is
truncated, corrupt or written for another fingerprint is skipped with a log
line, deleted, and never read into the cache. Files are written to a
temporary name and renamed, so a crash leaves no half file under a page's
name. The tier is LRU by last use (files' access order this run, their
modification times at start) within `max_bytes`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

log = logging.getLogger("jaxkv")

MAGIC = b"JAXKVPG1"
SUFFIX = ".kvpage"
_DIGEST = 32  # blake2b-256 checksum at the end of each file


def fingerprint(model, layout: list[tuple[tuple[int, ...], str]], kv_dtype: str,
                page_size: int, fp8_scales=None) -> str:
    """A hex name for what a page's bytes mean: the model's config, a digest
    of its weights (every parameter's shape, dtype and first 64 values), the
    KV dtype, page size, the paged leaves' `layout` [(shape, dtype)] and, for
    fp8, the scales the values are relative to."""
    import jax

    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(json.dumps([kv_dtype, page_size, [list(s) for s, _ in layout],
                         [d for _, d in layout]]).encode())
    from flax import nnx

    for path, x in sorted(jax.tree_util.tree_leaves_with_path(nnx.state(model)),
                          key=lambda kv: jax.tree_util.keystr(kv[0])):
        if not hasattr(x, "shape"):
            continue
        h.update(f"{jax.tree_util.keystr(path)}:{x.shape}:{x.dtype}".encode())
        flat = np.asarray(x.reshape(-1)[:64]) if x.size else np.zeros(0)
        h.update(np.ascontiguousarray(flat).view(np.uint8).tobytes())
    if fp8_scales is not None:
        for s in fp8_scales:
            h.update(np.asarray(s, np.float32).tobytes())
    return h.hexdigest()


class DiskTier:
    """Pages as files under `root`/`fp`, at most `max_bytes` of them; each
    page is `layout` [(shape, dtype)]: one array per paged cache leaf."""

    def __init__(self, root: str | os.PathLike, fp: str,
                 layout: list[tuple[tuple[int, ...], str]], max_bytes: int):
        self.dir = Path(root) / fp
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fp = fp.encode()
        self.layout = [(tuple(s), np.dtype(d)) for s, d in layout]
        self.payload = sum(int(np.prod(s)) * d.itemsize for s, d in self.layout)
        self.file_bytes = len(MAGIC) + len(self.fp) + 8 + self.payload + _DIGEST
        self.max_bytes = max_bytes
        if self.file_bytes > max_bytes:
            raise ValueError(f"kv_offload_disk: {max_bytes} bytes hold no page "
                             f"({self.file_bytes} bytes each)")
        found = []
        for f in self.dir.glob("*" + SUFFIX):
            try:
                found.append((f.stat().st_mtime, f.name[:-len(SUFFIX)]))
            except OSError:
                continue
        self._files: OrderedDict[str, None] = OrderedDict((n, None) for _, n in sorted(found))
        self._trim()
        if self._files:
            log.info("jaxkv: KV disk tier %s holds %d pages from an earlier run",
                     self.dir, len(self._files))

    def __contains__(self, h: bytes) -> bool:
        return h.hex() in self._files

    def __len__(self) -> int:
        return len(self._files)

    @property
    def nbytes(self) -> int:
        return len(self._files) * self.file_bytes

    def _path(self, name: str) -> Path:
        return self.dir / (name + SUFFIX)

    def write(self, h: bytes, data) -> bool:
        """Store one page (`layout`'s arrays); False (logged) when the
        file system refuses."""
        if len(data) != len(self.layout):
            raise ValueError(f"a page has {len(self.layout)} arrays, got {len(data)}")
        body = b"".join(np.ascontiguousarray(x, d).tobytes() for x, (_, d) in zip(data, self.layout))
        head = MAGIC + self.fp + len(body).to_bytes(8, "little")
        digest = hashlib.blake2b(head + body, digest_size=_DIGEST).digest()
        name, tmp = h.hex(), None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(head + body + digest)
            os.replace(tmp, self._path(name))
        except OSError as e:
            log.warning("jaxkv: KV disk tier: cannot write page %s (%s)", name, e)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return False
        self._files[name] = None
        self._files.move_to_end(name)
        self._trim()
        return True

    def read(self, h: bytes):
        """One page's arrays, or None (logged, the file deleted) when its
        file is missing, truncated, corrupt or another fingerprint's."""
        name = h.hex()
        path = self._path(name)
        try:
            raw = path.read_bytes()
        except OSError as e:
            return self._skip(name, f"unreadable ({e})")
        head = len(MAGIC) + len(self.fp) + 8
        if len(raw) != self.file_bytes:
            return self._skip(name, f"{len(raw)} bytes, a page file has {self.file_bytes}")
        if raw[:len(MAGIC)] != MAGIC or raw[len(MAGIC):len(MAGIC) + len(self.fp)] != self.fp:
            return self._skip(name, "written for another model or layout")
        if hashlib.blake2b(raw[:-_DIGEST], digest_size=_DIGEST).digest() != raw[-_DIGEST:]:
            return self._skip(name, "checksum mismatch")
        out, at = [], head
        for shape, dt in self.layout:
            n = int(np.prod(shape)) * dt.itemsize
            out.append(np.frombuffer(raw, dt, count=int(np.prod(shape)), offset=at).reshape(shape).copy())
            at += n
        self._files.move_to_end(name)
        return out

    def _skip(self, name: str, why: str):
        log.warning("jaxkv: KV disk tier: skipped page file %s: %s", self._path(name), why)
        self._files.pop(name, None)
        try:
            self._path(name).unlink()
        except OSError:
            pass
        return None

    def _trim(self) -> None:
        while self._files and len(self._files) * self.file_bytes > self.max_bytes:
            name, _ = self._files.popitem(last=False)
            try:
                self._path(name).unlink()
            except OSError:
                pass
