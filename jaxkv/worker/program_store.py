"""Compiled step programs kept on disk, so a warm start neither traces nor
compiles: `$JAXKV_CACHE/programs/<fingerprint>/<program>.bin`.

A program is stored after its first compile as XLA's own serialized
executable (`jax.experimental.serialize_executable`) with its argument and
result tree structures, behind a header (magic, format version, and an
HMAC-SHA256 of the payload under this user's secret key). The fingerprint names everything the compiled code depends
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

Trust: a stored program is code (a pickle, and machine code on CPU), so the
store reads only what this user wrote. Its folder must be private
(`pallas_kernels.private_dirs`: owned by the user, writable by no one
else; otherwise programs compile in memory, with a warning naming the
folder), and every entry must carry the MAC of the user's key, a random
secret kept outside the cache (`key_path`, mode 0600), checked before a
byte is unpickled. An entry without it is removed and compiled anew.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import pickle
import stat
import tempfile
from pathlib import Path
from typing import Any

from pallas_kernels import private_dirs

log = logging.getLogger("jaxkv")

MAGIC = b"JAXKVPRG"
VERSION = 3
KEY_BYTES = 32


def key_path() -> Path:
    """This user's secret for the program store, outside the cache:
    $JAXKV_KEY_FILE, else $XDG_CONFIG_HOME/jaxkv/cache.key (default
    ~/.config/jaxkv/cache.key)."""
    if os.environ.get("JAXKV_KEY_FILE"):
        return Path(os.environ["JAXKV_KEY_FILE"])
    config = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config) / "jaxkv" / "cache.key"


@functools.cache
def secret_key(path: Path | None = None) -> bytes:
    """The key at `path` (default `key_path()`), made on first use: random,
    in a file only this user may read or write. ValueError naming the file
    when it cannot be made or is not private."""
    return private_dirs.secret(path or key_path(), KEY_BYTES)


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
        native = (
            cpu_gemm.available(),
            rpa_cpu.available(),
            blocks.round_x_default(),
            cpu_gemm.projections(),
        )
    return dict(
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        platform=devices[0].platform,
        device_kind=devices[0].device_kind,
        devices=len(devices),
        processes=jax.process_count(),
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        native=native,
        sources=source_digest(),
    )


def _key_name(key) -> str:
    parts = [str(x) for x in (key if isinstance(key, tuple) else (key,))]
    name = "-".join(
        p.replace("ProgramKey(", "")
        .replace(")", "")
        .replace("'", "")
        .replace(", ", "_")
        .replace("=", "")
        for p in parts
    )
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
    def for_engine(cls, config) -> ProgramStore | None:
        """The store of an engine's runners under `$JAXKV_CACHE/programs`
        (None when `config.program_cache` is off, or the model is split over
        several devices or processes); each Runner adds its model and arguments to the
        fingerprint (`with_parts`)."""
        import jax

        if not config.program_cache or jax.process_count() > 1 or config.tensor_parallel_size > 1:
            return None
        from jaxkv.paths import private_cache

        root = private_cache(
            "programs",
            "compiled step programs are neither read nor kept there; they compile in memory",
        )
        if root is None:
            return None
        try:
            secret_key()
        except ValueError as e:
            log.warning(
                "jaxkv: the program store's key %s; compiled step programs are neither "
                "read nor kept (they compile in memory)",
                e,
            )
            return None
        return cls(root, platform_fingerprint())

    def with_parts(self, **parts: Any) -> ProgramStore:
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
            if not stat.S_ISREG(os.lstat(path).st_mode):
                raise ValueError("not a regular file")
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("jaxkv: stored program %s is unreadable (%s); compiling it again", path, e)
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
            prog = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, execution_devices=devices
            )
        except Exception as e:  # noqa: BLE001 - any bad entry is rebuilt, never fatal
            log.warning(
                "jaxkv: stored program %s is stale or corrupt (%s: %s); compiling it again",
                path,
                type(e).__name__,
                e,
            )
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
            payload = pickle.dumps(
                (blob, in_tree, out_tree, device_ids), protocol=pickle.HIGHEST_PROTOCOL
            )
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.dir)
            with os.fdopen(fd, "wb") as f:
                f.write(_wrap(payload))
            os.replace(tmp, self.path(key))
            self.saved += 1
        except Exception as e:  # noqa: BLE001 - a cache that cannot write is only slower
            if not self._warned:
                log.warning(
                    "jaxkv: cannot store compiled program %s (%s: %s); it compiles "
                    "again at the next start",
                    key,
                    type(e).__name__,
                    e,
                )
                self._warned = True


def _mac(payload: bytes) -> bytes:
    return hmac.new(secret_key(), payload, hashlib.sha256).digest()


def _wrap(payload: bytes) -> bytes:
    return MAGIC + VERSION.to_bytes(4, "little") + _mac(payload) + payload


def _unwrap(data: bytes) -> bytes:
    head = len(MAGIC) + 4 + 32
    if len(data) < head or data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a jaxkv program file")
    version = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    if version != VERSION:
        raise ValueError(f"format version {version}, expected {VERSION}")
    digest, payload = data[len(MAGIC) + 4 : head], data[head:]
    if not hmac.compare_digest(_mac(payload), digest):
        raise ValueError(
            "its MAC is not this user's key's (written by someone else, or corrupt); not unpickled"
        )
    return payload
