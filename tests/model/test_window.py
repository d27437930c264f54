"""Sliding windows and streaming eviction: pages that fall out of every
window go back to the pool while the sequence runs, and outputs match
Hugging Face's MistralForCausalLM (window) or an unevicted run (sinks)."""

import numpy as np
import pytest

from checkpoints.safetensors_io import load_hf_dir
from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama
from tests.helpers.model_utils import make_hf_model


def _held_pages_trace(eng, rid):
    """Step the engine to the end, recording the pages `rid` holds."""
    held, final = [], None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished and o.request_id == rid:
                final = o
        if rid in eng.bm:
            held.append(sum(p != 0 for p in eng.bm.block_table(rid)))
    return held, final


def test_mistral_window_frees_pages_and_matches_hf(tmp_path):
    import torch

    hf, path = make_hf_model(
        "mistral", tmp_path, sliding_window=12, num_key_value_heads=2, max_position_embeddings=512
    )
    config, params = load_hf_dir(path)
    assert config.sliding_window == 12
    model = Llama.from_params(config, params)
    prompt = list(np.random.default_rng(0).integers(3, 128, 20))
    want, ids = [], list(prompt)
    with torch.no_grad():  # greedy with full recompute: HF applies the window mask
        for _ in range(40):
            nxt = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            want.append(nxt)
            ids.append(nxt)
    # A pool of 10 pages x 4 tokens holds 36 tokens, less than the 60 the
    # sequence reaches: only freeing pages behind the window lets it finish.
    eng = LLMEngine(
        model, None, EngineConfig(warmup=False, num_pages=10, page_size=4, max_num_batched_tokens=8)
    )
    rid = eng.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    held, out = _held_pages_trace(eng, rid)
    assert out.outputs[0].token_ids == want
    assert max(held) <= 12 // 4 + 2, held


def test_streaming_eviction_runs_past_the_pool_with_bounded_pages():
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        eos_token_ids=(),
    )
    model = Llama.random_init(cfg, seed=2)
    prompt = list(range(5, 25))
    sp = SamplingParams(max_tokens=150, temperature=0)
    opts = dict(
        page_size=8,
        kv_eviction="streaming",
        streaming_window=24,
        num_sink_tokens=4,
        max_num_batched_tokens=16,
    )
    eng = LLMEngine(
        model, None, EngineConfig(warmup=False, num_pages=9, **opts)
    )  # 64 tokens of pool
    assert eng.max_model_len > 64
    rid = eng.add_request(prompt, sp)
    held, out = _held_pages_trace(eng, rid)
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 150
    assert max(held) <= 1 + 24 // 8 + 2, max(held)
    # Freeing pages changes nothing: the same run on a large pool that keeps
    # every page (same sink + window mask) gives the same tokens.
    keep = LLMEngine(model, None, EngineConfig(warmup=False, num_pages=40, **opts))
    keep.bm.release_range = lambda *a: 0
    r2 = keep.add_request(prompt, sp)
    assert keep.run_to_completion()[r2].outputs[0].token_ids == out.outputs[0].token_ids


def test_streaming_needs_the_reference_backend_for_sinks():
    import jax.numpy as jnp

    from pallas_kernels import ragged_paged_attention

    z = jnp.zeros
    with pytest.raises(ValueError, match="sink"):
        ragged_paged_attention(
            z((1, 2, 64)),
            z((1, 2, 8, 64)),
            z((1, 2, 8, 64)),
            z((1,), jnp.int32),
            z((1, 1), jnp.int32),
            z((2,), jnp.int32),
            jnp.int32(1),
            sm_scale=1.0,
            sliding_window=4,
            num_sink_tokens=2,
            backend="pallas",
        )
