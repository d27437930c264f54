"""Generation benchmarks (same as `jaxkv bench`): decode at batch 1/16/64,
prefill 256/1024, 64 mixed requests end to end, against Hugging Face
transformers with `--peer hf`. See jaxkv/bench.py for what is measured.

    python scripts/bench.py [--peer hf] [--json out.json] [--quick] [--runs N]
"""

import sys

from jaxkv.bench import main

if __name__ == "__main__":
    sys.exit(main())
