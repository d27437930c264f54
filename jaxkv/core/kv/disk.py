"""The disk tier of the KV offload (`jaxkv.core.kv.tiers`): pages the host
tier drops, one file each, found again by a restarted engine.

Layout: ``<kv_offload_dir>/<fingerprint>/<page hash>.kvpage``. The
fingerprint (`fingerprint`) names the model (its config and a digest of its
weights), the cache layout (KV dtype, page size, each paged leaf's shape and
dtype) and fp8's scales, so a file is only ever found by an engine whose
pages it fits. A file is a header (magic, fingerprint, payload length), the
page's arrays as raw bytes, and a keyed blake2b MAC of both under the
folder's secret (``<kv_offload_dir>/.key``, random, made with mode 0600 by
the first engine, refused when another user owns it or others may read
it): a page forged by anyone without the key is never served.

The folder is not trusted: only a regular file of exactly a page's size is
opened (no links followed, never blocking on a FIFO), and a file that is
anything else, truncated, corrupt, forged or another fingerprint's is
skipped with a log line, deleted, and never read into the cache; no
failure of one file fails a step. Files are written to a temporary name
and renamed, so a crash leaves no half file under a page's name.

`max_bytes` bounds the whole folder, shared by every engine on it (other
models' fingerprints too): the budget is counted from the folder itself at
each write, under a lock file, and the least recently used files go first
(a read touches its file's time, so engines share one order).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("jaxkv")

MAGIC = b"JAXKVPG2"
SUFFIX = ".kvpage"
KEY_FILE = ".key"
LOCK_FILE = ".lock"
_DIGEST = 32  # blake2b-256 MAC at the end of each file


def fingerprint(
    model, layout: list[tuple[tuple[int, ...], str]], kv_dtype: str, page_size: int, fp8_scales=None
) -> str:
    """A hex name for what a page's bytes mean: the model's config, a digest
    of its weights (every parameter's shape, dtype and first 64 values), the
    KV dtype, page size, the paged leaves' `layout` [(shape, dtype)] and, for
    fp8, the scales the values are relative to."""
    import jax

    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    h.update(
        json.dumps(
            [kv_dtype, page_size, [list(s) for s, _ in layout], [d for _, d in layout]]
        ).encode()
    )
    from flax import nnx

    for path, x in sorted(
        jax.tree_util.tree_leaves_with_path(nnx.state(model)),
        key=lambda kv: jax.tree_util.keystr(kv[0]),
    ):
        if not hasattr(x, "shape"):
            continue
        h.update(f"{jax.tree_util.keystr(path)}:{x.shape}:{x.dtype}".encode())
        flat = np.asarray(x.reshape(-1)[:64]) if x.size else np.zeros(0)
        h.update(np.ascontiguousarray(flat).view(np.uint8).tobytes())
    if fp8_scales is not None:
        for s in fp8_scales:
            h.update(np.asarray(s, np.float32).tobytes())
    return h.hexdigest()


def encode_page(data, layout, fp: bytes, key: bytes) -> bytes:
    """One page in the checksummed page format (the disk tier's files, the
    prefill/decode handoff's frames): header (magic, fingerprint, payload
    length), the arrays' raw bytes, and a blake2b MAC of both under `key`
    (an empty key: a plain checksum)."""
    if len(data) != len(layout):
        raise ValueError(f"a page has {len(layout)} arrays, got {len(data)}")
    body = b"".join(np.ascontiguousarray(x, d).tobytes() for x, (_, d) in zip(data, layout))
    head = MAGIC + fp + len(body).to_bytes(8, "little")
    return head + body + _mac(key, head + body)


def page_bytes(layout, fp: bytes) -> int:
    """The size of one encoded page."""
    return len(MAGIC) + len(fp) + 8 + sum(int(np.prod(s)) * d.itemsize for s, d in layout) + _DIGEST


def decode_page(raw: bytes, layout, fp: bytes, key: bytes):
    """The arrays of an encoded page; ValueError naming what is wrong
    (size, another model or layout, a MAC that does not match)."""
    if len(raw) != page_bytes(layout, fp):
        raise ValueError(f"{len(raw)} bytes, a page has {page_bytes(layout, fp)}")
    head = len(MAGIC) + len(fp) + 8
    if raw[: len(MAGIC)] != MAGIC or raw[len(MAGIC) : len(MAGIC) + len(fp)] != fp:
        raise ValueError("written for another model or layout")
    if not hmac.compare_digest(_mac(key, raw[:-_DIGEST]), raw[-_DIGEST:]):
        raise ValueError(
            "its MAC does not match the key (corrupt, or not written by a holder of the key)"
        )
    out, at = [], head
    for shape, dt in layout:
        n = int(np.prod(shape))
        out.append(np.frombuffer(raw, dt, count=n, offset=at).reshape(shape).copy())
        at += n * dt.itemsize
    return out


def _mac(key: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=_DIGEST, key=key).digest()


def folder_key(root: Path) -> bytes:
    """The folder's MAC key (made on first use, mode 0600). ValueError
    naming the file when another user owns it or others may read it."""
    from pallas_kernels import private_dirs

    try:
        return private_dirs.secret(root / KEY_FILE)[:64]
    except ValueError as e:
        raise ValueError(f"kv_offload_dir: {e}") from None


class DiskTier:
    """Pages as files under `root`/`fp`, the whole of `root` at most
    `max_bytes`; each page is `layout` [(shape, dtype)]: one array per
    paged cache leaf."""

    def __init__(
        self,
        root: str | os.PathLike,
        fp: str,
        layout: list[tuple[tuple[int, ...], str]],
        max_bytes: int,
    ):
        self.root = Path(root)
        self.dir = self.root / fp
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = folder_key(self.root)
        self.fp = fp.encode()
        self.layout = [(tuple(s), np.dtype(d)) for s, d in layout]
        self.file_bytes = page_bytes(self.layout, self.fp)
        self.max_bytes = max_bytes
        if self.file_bytes > max_bytes:
            raise ValueError(
                f"kv_offload_disk: {max_bytes} bytes hold no page ({self.file_bytes} bytes each)"
            )
        self._files: set[str] = set()
        self._trim()
        if self._files:
            log.info(
                "jaxkv: KV disk tier %s holds %d pages from an earlier run",
                self.dir,
                len(self._files),
            )

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
        raw = encode_page(data, self.layout, self.fp, self.key)
        name, tmp = h.hex(), None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(raw)
            os.replace(tmp, self._path(name))
            _touch(self._path(name))
        except OSError as e:
            log.warning("jaxkv: KV disk tier: cannot write page %s (%s)", name, e)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return False
        self._files.add(name)
        self._trim()
        return True

    def read(self, h: bytes):
        """One page's arrays, or None (logged, the file deleted) when its
        file is missing, not a regular file, truncated, corrupt, forged or
        another fingerprint's."""
        name = h.hex()
        path = self._path(name)
        try:
            raw = self._read_file(path)
        except (OSError, ValueError, MemoryError) as e:
            return self._skip(
                name,
                str(e) if isinstance(e, ValueError) else f"unreadable ({type(e).__name__}: {e})",
            )
        try:
            out = decode_page(raw, self.layout, self.fp, self.key)
        except ValueError as e:
            return self._skip(name, str(e))
        try:
            _touch(path)  # most recently used, for every engine on the folder
        except OSError:
            pass
        return out

    def _read_file(self, path: Path) -> bytes:
        """The bytes of a regular file of exactly one page's size (links
        not followed; a FIFO is opened without waiting, then refused)."""
        fd = os.open(
            path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        )
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            if st.st_size != self.file_bytes:
                raise ValueError(f"{st.st_size} bytes, a page file has {self.file_bytes}")
            raw = os.pread(fd, self.file_bytes + 1, 0)
        finally:
            os.close(fd)
        if len(raw) != self.file_bytes:
            raise ValueError(f"{len(raw)} bytes read, a page file has {self.file_bytes}")
        return raw

    def _skip(self, name: str, why: str):
        log.warning("jaxkv: KV disk tier: skipped page file %s: %s", self._path(name), why)
        self._files.discard(name)
        try:
            self._path(name).unlink()
        except OSError:
            pass
        return None

    def _trim(self) -> None:
        """Keep the folder within `max_bytes`, counted from the folder (every
        engine's files, by name: a fingerprint's files are all one size)
        under its lock at each write; only when it is over are the files'
        times read and the least recently used removed."""
        try:
            with open(self.root / LOCK_FILE, "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                subs = {}
                for sub in os.scandir(self.root):
                    if sub.is_dir(follow_symlinks=False):
                        subs[sub.name] = [
                            f.name for f in os.scandir(sub.path) if f.name.endswith(SUFFIX)
                        ]
                total = sum(len(names) * self._size(fp, names) for fp, names in subs.items())
                if total > self.max_bytes:
                    self._evict(subs, total)
                    subs[self.dir.name] = [
                        f.name for f in os.scandir(self.dir) if f.name.endswith(SUFFIX)
                    ]
        except OSError as e:
            log.warning("jaxkv: KV disk tier: cannot count %s (%s)", self.root, e)
            return
        self._files = {n[: -len(SUFFIX)] for n in subs.get(self.dir.name, ())}

    def _size(self, fp: str, names: list[str]) -> int:
        if fp == self.dir.name or not names:
            return self.file_bytes
        try:
            return os.stat(self.root / fp / names[0], follow_symlinks=False).st_size
        except OSError:
            return 0

    def _evict(self, subs: dict[str, list[str]], total: int) -> None:
        """Remove the least recently used files (any engine's) until the
        folder is within `max_bytes`."""
        files = []
        for fp, names in subs.items():
            for name in names:
                path = self.root / fp / name
                try:
                    st = os.stat(path, follow_symlinks=False)
                except OSError:
                    continue
                files.append((st.st_mtime_ns, st.st_size, path))
        files.sort()
        for _, size, path in files:
            if total <= self.max_bytes:
                break
            try:
                path.unlink()
            except OSError:
                continue
            total -= size


def _touch(path: Path) -> None:
    """Set the file's times to now at full resolution (the kernel's own
    stamps are coarse: files written in one tick would tie in LRU order)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now), follow_symlinks=False)
