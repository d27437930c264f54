"""The whole engine with attention_backend="pallas" (kernels in Pallas
interpret mode on CPU) gives the same greedy tokens as with the reference."""

import numpy as np
import pytest

from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.model.llama import Llama
from jaxkv.core.sampling_params import SamplingParams

CFG = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                  num_layers=2, num_heads=6, num_kv_heads=2, head_dim=64,
                  max_position_embeddings=256, eos_token_ids=())


def _run(backend, prompts, kv_dtype=None):
    model = Llama.random_init(CFG, seed=3)
    eng = LLMEngine(model, None, EngineConfig(warmup=False, num_pages=32, page_size=8, max_num_seqs=4,
                                              max_num_batched_tokens=32, kv_dtype=kv_dtype,
                                              attention_backend=backend))
    ids = [eng.add_request(p, SamplingParams(max_tokens=5, temperature=0)) for p in prompts]
    out = eng.run_to_completion()
    return [out[i].outputs[0].token_ids for i in ids]


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_pallas_backend_matches_reference_greedy_tokens(kv_dtype):
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, 97, n)) for n in (3, 11, 20)]
    ref = _run("reference", prompts, kv_dtype)
    assert _run("pallas", prompts, kv_dtype) == ref
