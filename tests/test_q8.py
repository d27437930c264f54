"""GGUF Q8_0 blocks kept as shipped (jaxkv.model.q8): the native matmul
against a float64 product of the dequantized weight, the blocks against
the gguf library's own dequantization, and an engine whose tied embedding
stays in blocks against the same engine on float32 weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from jaxkv.model import q8

pytestmark = pytest.mark.skipif(not q8.available(), reason="native CPU kernels unavailable")


def _blocks(rows, cols, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    return q8.Q8Blocks.from_gguf(quantize(w, Q.Q8_0), (rows, cols))


def test_blocks_read_as_the_gguf_library_dequantizes_them():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((37, 96)).astype(np.float32)
    raw = quantize(w, Q.Q8_0)
    b = q8.Q8Blocks.from_gguf(raw, w.shape)
    assert b.q.dtype == np.int8 and b.d.shape == (37, 3) and b.shape == (37, 96)
    np.testing.assert_array_equal(b.dequantize(), dequantize(raw, Q.Q8_0).reshape(w.shape))
    with pytest.raises(ValueError, match="Q8Blocks"):
        q8.Q8Blocks(b.q[:, :40], b.d)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
def test_native_matmul_matches_a_float64_product(rows):
    import jax
    import jax.numpy as jnp

    b = _blocks(700, 96)  # 700 rows: pieces of 256 and a ragged last one
    x = np.random.default_rng(rows).standard_normal((rows, 96)).astype(np.float32)
    want = x.astype(np.float64) @ b.dequantize().astype(np.float64).T
    for native in (True, False):
        got = jax.jit(lambda x, q, d, n=native: q8.matmul(x, q, d, n))(
            jnp.asarray(x), jnp.asarray(b.q), jnp.asarray(b.d))
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_an_engine_on_q8_blocks_gives_the_float32_engines_tokens(tmp_path):
    from checkpoints.loader import load_model
    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine
    from jaxkv.core.sampling_params import SamplingParams
    from tests.checkpoints.test_gguf_io import write_gguf

    path = tmp_path / "tied.gguf"
    write_gguf(path, arch="qwen2", tied=True)  # token_embd as Q8_0
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [[1, 5, 9, 2], [7] * 11, list(range(3, 30))]
    runs = {}
    for blocks in (True, False):
        module, tok = load_model(str(path), gguf_blocks=blocks)
        assert isinstance(module.embed, q8.Q8Table) == blocks
        eng = LLMEngine(module, tok, EngineConfig(warmup=False, num_pages=32, max_num_seqs=4))
        ids = [eng.add_request(p, params) for p in prompts]
        fin = eng.run_to_completion()
        runs[blocks] = [(fin[i].outputs[0].token_ids, [lp.logprob for lp in fin[i].outputs[0].logprobs])
                        for i in ids]
    for (tb, lb), (tf, lf) in zip(runs[True], runs[False]):
        assert tb == tf
        np.testing.assert_allclose(lb, lf, atol=1e-4)
