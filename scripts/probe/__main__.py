"""Adversarial probe of the engine, the batch job, the server and the
checkpoint loaders: a careless user's and an attacker's input beside
ordinary requests. A benchmark, not a test (a few minutes on 2 cores).

    python scripts/probe/__main__.py [--parts offline,batch,http,checkpoints,files] [--json OUT]

Each probe ends in one outcome (scripts/probe/common.py): served (an
ordinary request answered as its lone run answers), named (a bad input
refused, the error naming the problem), or a bad one: unnamed, wrong,
crashes, lost, hangs, memory. It prints a table of counts by part and every
bad outcome, and exits 1 if there is any. The model is a random 2-layer
llama with SmolLM2's real tokenizer, saved as a jaxkv checkpoint; only the
public API and commands are used."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.probe.common import Tally, make_tiny_model, timed  # noqa: E402

PARTS = ("offline", "batch", "http", "checkpoints", "files")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS)
    )
    ap.add_argument("--json", type=Path, help="also write the counts and failures here")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts: unknown {unknown}; choose from {', '.join(PARTS)}")
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="jaxkv-probe-") as tmp:
        root = Path(tmp)
        model = (
            make_tiny_model(root / "model")
            if set(parts) & {"offline", "batch", "http", "files"}
            else None
        )
        for part in parts:
            with timed(tally, part):
                if part == "offline":
                    from scripts.probe.offline import run_offline

                    run_offline(tally, model)
                elif part == "batch":
                    from scripts.probe.offline import run_batch

                    run_batch(tally, root / "batch", model)
                elif part == "http":
                    from scripts.probe.serve import run

                    run(tally, root / "http", model)
                elif part == "files":
                    from scripts.probe.files import run

                    run(tally, root / "files", model)
                else:
                    from scripts.probe.checkpoint_files import run

                    run(tally, root / "checkpoints")
            print(f"{part}: done in {tally.seconds[part]:.0f} s", file=sys.stderr, flush=True)
    print(tally.table())
    for line in tally.failures:
        print("BAD", line)
    if args.json:
        args.json.write_text(tally.to_json())
    print(f"{tally.bad()} bad outcomes" if tally.bad() else "no bad outcomes")
    return 1 if tally.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
