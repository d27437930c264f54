"""`python -m jaxkv ...` is the `jaxkv` command."""

import sys

from jaxkv.entrypoints.cli import main

sys.exit(main())
