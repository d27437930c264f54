"""Batch generation over a JSONL file (same as `jaxkv batch`).

python scripts/tools/batch_generate.py IN.jsonl OUT.jsonl [--model M] [--max-tokens N]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from jaxkv.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
