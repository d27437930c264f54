"""Batch generation over a JSONL file (same as `jaxkv batch`).

    python scripts/batch_generate.py IN.jsonl OUT.jsonl [--model M] [--max-tokens N]
"""

import sys

from jaxkv.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["batch", *sys.argv[1:]]))
