"""The files part of the adversarial probe (scripts/probe/__main__.py): what another user of the machine may
plant in jaxkv's folders.

- Program store: `jaxkv generate` fills a private cache; its entries are then replaced by pickles
  that write a marker file when unpickled (their checksums recomputed, as an attacker can), once
  in the private folder and once in a copy made shared (mode 1777). Each following `jaxkv generate`
  must answer as the first did and never create the marker.
- KV disk tier: a FIFO, a link to /dev/zero, a 2 GB sparse file and a forged page (its checksum
  recomputed without the folder's key) in place of page files are each skipped within a second;
  two tiers of different models on one folder stay within their one budget.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from scripts.probe.common import Tally

PART = "files"


class Planted:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _generate(model: Path, cache: Path) -> tuple[int, str, str]:
    env = dict(os.environ, JAXKV_CACHE=str(cache))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxkv",
            "generate",
            "--model",
            str(model),
            "--raw",
            "--max-tokens",
            "6",
            "--no-warmup",
            "Hello there",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return r.returncode, r.stdout.strip(), r.stderr


def _plant(folder: Path, marker: Path) -> int:
    from jaxkv.worker import program_store as ps

    payload = pickle.dumps((Planted(str(marker)), None, None, [0]))
    data = ps.MAGIC + ps.VERSION.to_bytes(4, "little") + hashlib.sha256(payload).digest() + payload
    files = sorted(folder.rglob("*.bin"))
    for f in files:
        f.write_bytes(data)
    return len(files)


def program_store(tally: Tally, root: Path, model: Path) -> None:
    private, shared, marker = root / "private", root / "shared", root / "planted-code-ran"
    rc, want, err = _generate(model, private)
    if rc != 0 or not list(private.rglob("*.bin")):
        tally.add(PART, "crashes", "program store: first run", f"rc {rc}: {err[-300:]}")
        return
    shutil.copytree(private / "programs", shared / "programs")
    for d in [shared, *[p for p in shared.rglob("*") if p.is_dir()]]:
        d.chmod(0o1777)
    for case, cache in (
        ("planted in the private cache", private),
        ("planted in a shared (1777) cache", shared),
    ):
        n = _plant(cache / "programs", marker)
        rc, got, err = _generate(model, cache)
        if marker.exists():
            tally.add(PART, "crashes", f"program store: {case}", f"{n} planted entries ran code")
            marker.unlink()
        elif rc != 0 or got != want:
            tally.add(PART, "wrong", f"program store: {case}", f"rc {rc}, {got!r} vs {want!r}")
        else:
            said = "not unpickled" in err or "not using the cache folder" in err
            tally.add(
                PART,
                "named" if said else "unnamed",
                f"program store: {case}",
                err.strip().splitlines()[-1][:200] if err.strip() else "nothing logged",
            )


def disk_tier(tally: Tally, root: Path) -> None:
    from jaxkv.core.kv import disk as kv_disk

    layout = [((2, 16, 64), "float32")]
    page = [np.ones((2, 16, 64), np.float32)]
    tier = kv_disk.DiskTier(root / "kv", "fp", layout, max_bytes=64 << 20)
    hashes = {
        name: name.encode().ljust(16, b"_")[:16]
        for name in ("fifo", "dev_zero", "two_gb", "forged")
    }
    for h in hashes.values():
        tier.write(h, page)
    paths = {name: tier._path(h.hex()) for name, h in hashes.items()}
    for p in paths.values():
        p.unlink()
    os.mkfifo(paths["fifo"])
    paths["dev_zero"].symlink_to("/dev/zero")
    with open(paths["two_gb"], "wb") as f:
        f.truncate(2 << 30)
    tier.write(hashes["forged"], page)
    raw = bytearray(paths["forged"].read_bytes())
    raw[100] ^= 1
    raw[-32:] = hashlib.blake2b(bytes(raw[:-32]), digest_size=32).digest()
    paths["forged"].write_bytes(bytes(raw))
    for name, h in hashes.items():
        t0 = time.monotonic()
        try:
            got = tier.read(h)
        except Exception as e:  # noqa: BLE001 - every failure is classified
            tally.add(PART, "crashes", f"disk tier: {name}", f"{type(e).__name__}: {e}")
            continue
        took = time.monotonic() - t0
        gone = not (paths[name].exists() or paths[name].is_symlink())
        outcome = (
            "named" if got is None and gone and took < 1.0 else "hangs" if took >= 1.0 else "wrong"
        )
        tally.add(
            PART,
            outcome,
            f"disk tier: {name}",
            f"served {got is not None}, removed {gone}, {took:.2f}s",
        )
    size = kv_disk.DiskTier(root / "sizing", "a", layout, max_bytes=1 << 30).file_bytes
    a = kv_disk.DiskTier(root / "shared-kv", "a", layout, max_bytes=8 * size)
    b = kv_disk.DiskTier(root / "shared-kv", "b", layout, max_bytes=8 * size)
    worst = 0
    for i in range(40):
        a.write(bytes([i]) * 16, page)
        b.write(bytes([100 + i]) * 16, page)
        worst = max(worst, sum(f.stat().st_size for f in (root / "shared-kv").rglob("*.kvpage")))
    tally.add(
        PART,
        "served" if worst <= 8 * size else "memory",
        "disk tier: two engines, one budget",
        f"at most {worst / size:.0f} pages on disk for a budget of 8",
    )


def run(tally: Tally, root: Path, model: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    disk_tier(tally, root)
    program_store(tally, root, model)
