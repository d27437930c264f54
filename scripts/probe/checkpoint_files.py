"""The checkpoint part of the adversarial probe: hostile checkpoints fed to the
public converter, `python -m jaxkv convert SRC DST`.

`run(tally, root)` builds 39 tiny checkpoints under `root` (Hugging Face
folders, GGUF files, jaxkv checkpoints, and paths that are none of them), each
broken in one way, plus three good controls, and converts each in a child
process limited to 4 GiB of address space and 60 s of wall time. Outcomes
(see probe_common): a control that converts is served; a hostile source
refused with exit status != 0 and one `error: ...` line naming the problem
(a regex per case) is named; a refusal that does not name it is unnamed; a
traceback is crashes; a hostile source converted (status 0) is wrong; no
answer in 60 s is hangs; a MemoryError or a death by signal is memory. The
builders and the case tables live in scripts/probe/checkpoint_builders.py.

    .venv/bin/python scripts/probe/checkpoint_files.py   # table; exit 1 on any bad outcome
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.probe.checkpoint_builders import CASES, CONTROLS
from scripts.probe.common import Tally, timed

PART = "checkpoints"
MEMORY_LIMIT = 4 << 30
TIMEOUT_S = 60
REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- the probe
def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def convert(src: Path, dst: Path) -> tuple[int | None, str]:
    """(exit status or None on timeout, stderr) of `jaxkv convert SRC DST` in
    a limited child; its whole process group is killed on timeout."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxkv", "convert", str(src), str(dst)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_limit,
        start_new_session=True,
    )  # noqa: PLW1509 (one setrlimit call)
    try:
        _, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err.decode(errors="replace")
    return proc.returncode, err.decode(errors="replace")


def classify(rc: int | None, err: str, pattern: str | None) -> tuple[str, str]:
    """(outcome, detail) of one conversion; `pattern` None for a control."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if rc is None:
        return "hangs", f"no answer in {TIMEOUT_S} s; stderr: {last[:200]}"
    if "MemoryError" in err or rc < 0:
        return "memory", f"rc {rc}: {last[:250]}"
    if "Traceback (most recent call last)" in err:
        return "crashes", f"rc {rc}: {last[:250]}"
    if pattern is None:
        return ("served", "") if rc == 0 else ("unnamed", f"control refused, rc {rc}: {last[:250]}")
    if rc == 0:
        return "wrong", "the hostile source converted (rc 0)"
    if len(lines) != 1 or not last.startswith("error: "):
        return "unnamed", f"rc {rc}, {len(lines)} stderr lines: {' | '.join(lines)[:250]}"
    if not re.search(pattern, last):
        return "unnamed", f"rc {rc}, does not match {pattern!r}: {last[:250]}"
    return "named", ""


def _probe(
    root: Path, case: str, make: Callable[[Path], Path], pattern: str | None
) -> tuple[str, str, str]:
    d = root / case
    d.mkdir(parents=True)
    try:
        src = make(d)
    except Exception as e:  # noqa: BLE001 (a builder failure is the probe's own bug: reported, never good)
        return case, "crashes", f"builder failed: {type(e).__name__}: {e}"
    rc, err = convert(src, d / "out")
    outcome, detail = classify(rc, err, pattern)
    if outcome == "named" and (d / "out").exists():
        outcome, detail = "wrong", "refused, but left an output directory"
    return case, outcome, detail


def run(tally: Tally, root: Path) -> None:
    """Convert every hostile case and control under `root`, two at a time
    (bounded: one child per case, each killed after TIMEOUT_S)."""
    root = Path(root)
    jobs = [(c, m, p) for c, (m, p) in CASES.items()] + [(c, m, None) for c, m in CONTROLS.items()]
    with timed(tally, PART), warnings.catch_warnings(), ThreadPoolExecutor(max_workers=2) as pool:
        # The builders start JAX's threads; the children exec at once (preexec_fn only sets a limit),
        # and one that deadlocked before its exec would show as a hang.
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        for case, outcome, detail in pool.map(lambda j: _probe(root, *j), jobs):
            tally.add(PART, outcome, case, detail)
            print(f"{case:28s} {outcome:8s} {detail[:160]}", flush=True)


if __name__ == "__main__":
    import tempfile
    import time

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="probe_checkpoints-") as tmp:
        result = Tally()
        run(result, Path(tmp))
    print(result.table())
    for line in result.failures:
        print(line)
    print(f"wall {time.perf_counter() - t0:.0f} s")
    sys.exit(1 if result.bad() else 0)
