"""Compiled step programs kept on disk, so a warm start neither traces nor
compiles: `$JAXKV_CACHE/programs/<fingerprint>/<program>.bin`.

A program is stored after its first compile as XLA's own serialized
executable (`jax.experimental.serialize_executable`) with its argument and
result tree structures, behind a header (magic, format version, SHA-256 of
the payload). The fingerprint names everything the compiled code depends
on besides the program's key: the model's graph (architecture, config,
quantization) and every argument's shape, dtype and sharding, the bucket
shapes and attention choice, the JAX and jaxlib versions, the platform and
its devices, the XLA flags, and a digest of jaxkv's own sources (an edited
kernel or step function gets a new folder). An entry that is stale
(another JAX) or corrupt (a torn write, a flipped bit) is ignored with a
log line, removed, and compiled anew.

JAX's persistent compilation cache (`jax_compilation_cache_dir`, also on)
skips XLA's compile but not JAX's tracing and lowering of the program;
this store skips both.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("jaxkv")

MAGIC = b"JAXKVPRG"
VERSION = 2


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """SHA-256 over jaxkv's and pallas_kernels' Python and C++ sources
    (the two packages sit side by side, installed or in a checkout)."""
    h = hashlib.sha256()
    top = Path(__file__).resolve().parents[2]
    for root in (top / "jaxkv", top / "pallas_kernels"):
        for p in sorted(root.rglob("*")):
            if p.suffix in (".py", ".cc") and p.is_file():
                h.update(str(p.relative_to(root)).encode())
                h.update(p.read_bytes())
    return h.hexdigest()


def platform_fingerprint() -> dict:
    """What of this process the compiled code depends on. On CPU this also
    loads the native kernels (`pallas_kernels.native`), whose custom-call
    targets a stored program calls by name and which must be registered
    before it runs."""
    import jax
    import jaxlib

    devices = jax.devices()
    native = None
    if devices[0].platform == "cpu":
        from jaxkv.model import blocks, cpu_gemm
        from pallas_kernels.ragged_paged_attention import cpu as rpa_cpu

        # whether GGUF block matmuls round x and which GEMM runs the
        # projections (both read when a step is traced)
        native = (cpu_gemm.available(), rpa_cpu.available(), blocks.round_x_default(),
                  cpu_gemm.projections())
    return dict(jax=jax.__version__, jaxlib=jaxlib.__version__,
                platform=devices[0].platform, device_kind=devices[0].device_kind,
                devices=len(devices), processes=jax.process_count(),
                xla_flags=os.environ.get("XLA_FLAGS", ""), native=native,
                sources=source_digest())


def _key_name(key) -> str:
    parts = [str(x) for x in (key if isinstance(key, tuple) else (key,))]
    name = "-".join(p.replace("ProgramKey(", "").replace(")", "").replace("'", "")
                    .replace(", ", "_").replace("=", "") for p in parts)
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)[:120]


class ProgramStore:
    """Compiled programs of one fingerprint under `root`."""

    def __init__(self, root: str | os.PathLike, fingerprint: dict[str, Any]):
        self.root = Path(root)
        self.fingerprint = dict(fingerprint)
        digest = hashlib.sha256(repr(sorted(self.fingerprint.items())).encode()).hexdigest()
        self.dir = self.root / digest[:24]
        self.loaded = 0
        self.saved = 0
        self._warned = False

    @classmethod
    def for_engine(cls, config) -> "ProgramStore | None":
        """The store of an engine's runners under `$JAXKV_CACHE/programs`
        (None when `config.program_cache` is off, or the model is split over
        several devices or processes); each Runner adds its model and arguments to the
        fingerprint (`with_parts`)."""
        import jax

        if (not config.program_cache or jax.process_count() > 1
                or config.tensor_parallel_size > 1):
            return None
        from jaxkv.paths import cache_dir

        return cls(cache_dir() / "programs", platform_fingerprint())

    def with_parts(self, **parts: Any) -> "ProgramStore":
        """A store whose fingerprint also names `parts` (each hashed by its
        repr)."""
        extra = {k: hashlib.sha256(repr(v).encode()).hexdigest() for k, v in parts.items()}
        return ProgramStore(self.root, {**self.fingerprint, **extra})

    def path(self, key) -> Path:
        return self.dir / f"{_key_name(key)}.bin"

    def load(self, key):
        """The compiled program of `key`, or None (absent, stale or corrupt:
        then the entry is removed and the caller compiles it)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            return None
        try:
            payload = _unwrap(data)
            blob, in_tree, out_tree, device_ids = pickle.loads(payload)
            import jax
            from jax.experimental import serialize_executable

            by_id = {d.id: d for d in jax.devices()}
            # the devices it was compiled for (by default it would load onto
            # every device, and a one-device program then asks for a shard
            # on each)
            devices = [by_id[i] for i in device_ids]
            prog = serialize_executable.deserialize_and_load(blob, in_tree, out_tree,
                                                             execution_devices=devices)
        except Exception as e:  # noqa: BLE001 - any bad entry is rebuilt, never fatal
            log.warning("jaxkv: stored program %s is stale or corrupt (%s: %s); compiling it "
                        "again", path, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        return prog

    def save(self, key, compiled) -> None:
        """Keep `compiled` (a jax.stages.Compiled) for the next run; a
        failure (a program with a host callback, as Pallas interpret mode
        makes, cannot be serialized) is logged once and that program
        compiles again next time."""
        try:
            from jax.experimental import serialize_executable

            blob, in_tree, out_tree = serialize_executable.serialize(compiled)
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            payload = pickle.dumps((blob, in_tree, out_tree, device_ids),
                                   protocol=pickle.HIGHEST_PROTOCOL)
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.dir)
            with os.fdopen(fd, "wb") as f:
                f.write(_wrap(payload))
            os.replace(tmp, self.path(key))
            self.saved += 1
        except Exception as e:  # noqa: BLE001 - a cache that cannot write is only slower
            if not self._warned:
                log.warning("jaxkv: cannot store compiled program %s (%s: %s); it compiles "
                            "again at the next start", key, type(e).__name__, e)
                self._warned = True


def _wrap(payload: bytes) -> bytes:
    return MAGIC + VERSION.to_bytes(4, "little") + hashlib.sha256(payload).digest() + payload


def _unwrap(data: bytes) -> bytes:
    head = len(MAGIC) + 4 + 32
    if len(data) < head or data[:len(MAGIC)] != MAGIC:
        raise ValueError("not a jaxkv program file")
    version = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
    if version != VERSION:
        raise ValueError(f"format version {version}, expected {VERSION}")
    digest, payload = data[len(MAGIC) + 4:head], data[head:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch")
    return payload
