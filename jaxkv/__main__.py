"""`python -m jaxkv ...` is the `jaxkv` command."""

from jaxkv.entrypoints.cli import run

run()
