"""Native CPU kernels: C++ sources built on first use into XLA FFI custom
calls, backed by Intel MKL (the `mkl` wheel, a dependency on x86-64 Linux).

Why native code on CPU: XLA's CPU GEMMs (YNNPACK) run SmolLM2's prefill
matmuls at ~145 GFLOP/s on a 2-core Xeon where MKL's sgemm, the library
torch uses, runs them at ~190; and a flash attention that keeps each score
tile in L2 cannot be spelled in jnp (every XLA op makes a pass over the
whole tile). So on CPU the large matmuls and the ragged paged attention
call native code through `jax.ffi`, like any other XLA custom call: no Python on the
hot path, no copies, one program per shape bucket as before.

`load(name, source, symbols)` compiles `source` with the system C++
compiler (g++ or $CXX) against jaxlib's FFI headers and MKL, keeps the
library in ``$JAXKV_CACHE/native`` under a hash of everything that shapes
it (source, flags, compiler, jaxlib, MKL, the CPU's instruction set), and
registers each symbol as the CPU FFI target "jaxkv_<symbol>". Where MKL or
a compiler is missing, or the build fails, it returns False once with the
reason in `unavailable()`, and callers keep their XLA path; so does
JAXKV_NATIVE_CPU=0 (for A/B runs and tests of the fallback).

The BLAS behind the kernels' sgemm calls (`blas.h`) is chosen per CPU when
a library loads (`blas()`): MKL on Intel CPUs, numpy's bundled OpenBLAS
(DYNAMIC_ARCH: its kernels picked for the CPU it runs on, Zen included) on
every other x86 CPU, where MKL's sgemm is not tuned (measured on an AMD
EPYC VM: prefill at 0.77-0.86x transformers with MKL); JAXKV_CPU_BLAS=mkl or
=openblas overrides it (`scripts/bench/blas.py` measures both and XLA's own
dots on the CPU it runs on).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from pallas_kernels import private_dirs

_LOCK = threading.Lock()
_LOADED: dict[str, bool] = {}
_REASONS: dict[str, str] = {}
_MKL_LIBS = ("libmkl_intel_lp64", "libmkl_gnu_thread", "libmkl_core")


def enabled() -> bool:
    """Whether native CPU kernels may be used at all (JAXKV_NATIVE_CPU != 0)."""
    return os.environ.get("JAXKV_NATIVE_CPU", "1") not in ("0", "false", "no", "off")


def mkl_dir() -> Path | None:
    """The directory holding MKL's shared libraries (the `mkl` wheel puts
    them in <prefix>/lib), or None."""
    import site
    import sysconfig

    cands = [
        Path(sys.prefix) / "lib",
        Path(sys.base_prefix) / "lib",
        Path(site.getuserbase()) / "lib",
        Path(sysconfig.get_config_var("LIBDIR") or "/"),
    ]
    for d in cands:
        if all(glob.glob(str(d / f"{lib}.so*")) for lib in _MKL_LIBS):
            return d
    return None


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD, ...), or ""."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def openblas_path() -> Path | None:
    """numpy's bundled OpenBLAS (64-bit integers), or None."""
    import numpy

    libs = sorted(
        (Path(numpy.__file__).parent.parent / "numpy.libs").glob("libscipy_openblas64_*.so*")
    )
    return libs[0] if libs else None


def blas() -> str:
    """The BLAS the native kernels call in this process: "mkl" or "openblas"
    (JAXKV_CPU_BLAS, else MKL on Intel and OpenBLAS on other CPUs, MKL
    where numpy has no OpenBLAS)."""
    want = os.environ.get("JAXKV_CPU_BLAS", "auto").lower()
    if want not in ("auto", "mkl", "openblas"):
        raise ValueError(f"JAXKV_CPU_BLAS: expected auto, mkl or openblas, got {want!r}")
    if want == "auto":
        want = "mkl" if cpu_vendor() == "GenuineIntel" else "openblas"
    if want == "openblas" and openblas_path() is None:
        if os.environ.get("JAXKV_CPU_BLAS", "auto").lower() == "openblas":
            raise RuntimeError("JAXKV_CPU_BLAS=openblas: numpy has no bundled OpenBLAS here")
        return "mkl"
    return want


_OPENBLAS: list = []  # the loaded library, kept for the process's life
_POOL: list = []  # pool.cc's library: the worker threads every kernel shares (pool.h)


def _use_blas(lib: ctypes.CDLL) -> None:
    """Point `lib`'s sgemm calls at the BLAS `blas()` names (MKL is linked)."""
    if blas() != "openblas":
        return
    if not _OPENBLAS:
        _OPENBLAS.append(ctypes.CDLL(str(openblas_path())))
    ob = _OPENBLAS[0]
    addr = [
        ctypes.cast(f, ctypes.c_void_p).value
        for f in (ob.scipy_cblas_sgemm64_, ob.openblas_set_num_threads_local)
    ]
    lib.jaxkv_blas_use.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.jaxkv_blas_use(*addr)


_PRIVATE: list[Path] = []  # this process's own folder, when the cache's is not private


def _cache_root() -> Path:
    """``$JAXKV_CACHE/native`` (the root of jaxkv.paths.cache_dir; this
    package imports no jaxkv) when no other user can write it, else a
    temporary folder of this process's own (a library there is loaded as
    code: see `private_dirs`)."""
    root = Path(os.environ.get("JAXKV_CACHE") or Path.home() / ".cache" / "jaxkv") / "native"
    if _PRIVATE:
        return _PRIVATE[0]
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        why = private_dirs.problem(root) or private_dirs.problem(root.parent)
    except OSError as e:
        why = f"{root} cannot be made ({e.strerror or e})"
    if why is None:
        return root
    import atexit
    import warnings

    _PRIVATE.append(Path(tempfile.mkdtemp(prefix="jaxkv-native-")))
    atexit.register(shutil.rmtree, _PRIVATE[0], True)
    warnings.warn(
        f"jaxkv: not using the native kernel folder {root}: {why}; building in "
        f"{_PRIVATE[0]} for this process (make it private, e.g. chmod 700, or set "
        "JAXKV_CACHE to a folder of your own)",
        RuntimeWarning,
        stacklevel=4,
    )
    return _PRIVATE[0]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(name: str, source: Path, mkl: Path) -> Path:
    import jax
    import jaxlib

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) on PATH")
    libs = []
    for lib in _MKL_LIBS:  # link the versioned file itself (the wheel has no .so links)
        libs.append("-l:" + Path(sorted(glob.glob(str(mkl / f"{lib}.so*")))[-1]).name)
    flags = [
        "-O3",
        "-march=native",
        "-fopenmp",
        "-shared",
        "-fPIC",
        "-std=c++17",
        "-fno-math-errno",
        "-w",
        f"-I{jax.ffi.include_dir()}",
        f"-I{Path(__file__).parent}",
    ]
    link = [f"-L{mkl}", f"-Wl,-rpath,{mkl}", *libs, "-lgomp", "-lpthread", "-lm", "-ldl"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [
                source.read_text(),
                *(Path(__file__).with_name(h).read_text() for h in ("blas.h", "pool.h")),
                " ".join(flags + link),
                version,
                jax.__version__,
                jaxlib.__version__,
                str(mkl),
                platform.machine(),
                _cpu_flags(),
            ]
        ).encode()
    ).hexdigest()[:16]
    out = _cache_root() / f"{name}-{key}.so"
    if out.exists():
        bad = private_dirs.private_file(out)
        if bad is None:
            return out
        raise RuntimeError(f"refusing to load {out}: {bad}")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run(
            [cxx, *flags, str(source), "-o", tmp, *link], capture_output=True, text=True
        )
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {source.name}: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key is identical
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(name: str, source: Path, symbols: tuple[str, ...]) -> bool:
    """Build (once per machine, cached) and register `source`'s FFI handlers
    `symbols` as CPU targets "jaxkv_<symbol>". True when they are ready."""
    with _LOCK:
        if name in _LOADED:
            return _LOADED[name]
        ok = False
        if not enabled():
            _REASONS[name] = "disabled by JAXKV_NATIVE_CPU=0"
        elif platform.machine() not in ("x86_64", "AMD64") or sys.platform != "linux":
            _REASONS[name] = (
                f"native CPU kernels are built for x86-64 Linux only "
                f"(this is {sys.platform} {platform.machine()})"
            )
        elif (mkl := mkl_dir()) is None:
            _REASONS[name] = "Intel MKL not found (pip install mkl)"
        else:
            try:
                import jax

                if not _POOL:  # the kernels resolve its symbols: loaded first, global
                    pool = _build("pool", Path(__file__).with_name("pool.cc"), mkl)
                    _POOL.append(ctypes.CDLL(str(pool), mode=ctypes.RTLD_GLOBAL))
                lib = ctypes.cdll.LoadLibrary(str(_build(name, source, mkl)))
                _use_blas(lib)
                for sym in symbols:
                    jax.ffi.register_ffi_target(
                        f"jaxkv_{sym}", jax.ffi.pycapsule(getattr(lib, sym)), platform="cpu"
                    )
                ok = True
            except Exception as e:  # the XLA path still serves; say why once
                _REASONS[name] = f"{type(e).__name__}: {e}"
        if not ok and enabled():
            import warnings

            warnings.warn(
                f"jaxkv: native CPU kernels '{name}' unavailable, using XLA's ({_REASONS[name]})",
                RuntimeWarning,
                stacklevel=3,
            )
        _LOADED[name] = ok
        return ok


def unavailable(name: str) -> str | None:
    """Why `load(name, ...)` returned False (None if it did not, or was not called)."""
    return _REASONS.get(name)
