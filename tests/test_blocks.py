"""Layer matmul weights kept in their GGUF blocks (jaxkv.model.blocks): the
native matmul of each block type against a float64 product of the gguf
library's dequantization, on the register path (few rows) and the sgemm
path (many); and an engine loading a GGUF whose layers mix kept and
dequantized types against the same engine on float32 weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from jaxkv.model import blocks

pytestmark = pytest.mark.skipif(not blocks.available(), reason="native CPU kernels unavailable")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
def test_native_block_matmul_matches_a_float64_product(qtype):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(int(qtype))
    rows, cols = 300, 96  # pieces of 128 rows and a ragged last one
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    bw = blocks.BlockWeight(quantize(w, qtype), qtype, rows, cols, (cols, rows))
    ref = bw.dequantize().astype(np.float64)
    assert np.abs(ref - w).max() < 0.2 * np.abs(w).max()  # the blocks hold w
    fn = jax.jit(lambda x, raw: blocks.matmul(x, raw, int(qtype)))
    for t in (1, 5, 8, 9, 32, 40):  # groups of 8, a ragged group, the sgemm path
        x = rng.standard_normal((t, cols)).astype(np.float32)
        want = x.astype(np.float64) @ ref.T
        got = np.asarray(fn(jnp.asarray(x), jnp.asarray(bw.raw)))
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=str(t))


def test_a_block_weight_of_the_wrong_size_is_refused():
    raw = np.zeros((4, 3 * 20), np.uint8)
    with pytest.raises(ValueError, match="Q4_1 rows of 96 values"):
        blocks.BlockWeight(raw[:, :50], Q.Q4_1, 4, 96, (96, 4))


def test_an_engine_on_gguf_blocks_gives_the_float32_engines_tokens(tmp_path):
    from checkpoints.loader import load_model
    from tests.checkpoints.test_gguf_io import write_gguf
    from tests.model_utils import greedy_runs

    # llama (q/k rows permuted in the file): q F16, k Q8_0, v Q4_0, o Q4_1,
    # gate BF16, up Q5_0, down Q5_1; the first four block types are kept.
    path = tmp_path / "mixed.gguf"
    write_gguf(path, arch="llama", tied=True)
    prompts = [[1, 5, 9, 2], [7] * 11, list(range(3, 39))]
    runs = {}
    for keep in (True, False):
        module, tok = load_model(str(path), gguf_blocks=keep)
        attn, block = module.layers[0].attn, module.layers[0]
        kinds = (attn.wqkv.kinds, attn.wo.kinds, block.w_gate_up.kinds) if keep else None
        assert kinds in (None, ((0, int(Q.Q8_0), int(Q.Q4_0)), (int(Q.Q4_1),), (0, int(Q.Q5_0))))
        runs[keep] = greedy_runs(module, tok, prompts)
    for (tb, lb), (tf, lf) in zip(runs[True], runs[False]):
        assert tb == tf
        np.testing.assert_allclose(lb, lf, atol=1e-3)
    with pytest.raises(ValueError, match="gguf_blocks and quantize"):
        load_model(str(path), gguf_blocks=True, quantize="int8")


def test_blocks_are_refused_by_name_where_the_native_matmul_cannot_run_them():
    from jaxkv.config import EngineConfig

    assert blocks.keep_gguf_blocks(EngineConfig()) is False  # opt-in
    assert blocks.keep_gguf_blocks(EngineConfig(gguf_blocks=True)) is True
    with pytest.raises(ValueError, match="gguf_blocks: .* need dtype float32"):
        blocks.keep_gguf_blocks(EngineConfig(gguf_blocks=True, dtype="bfloat16"))
    with pytest.raises(ValueError, match="need one device"):
        blocks.keep_gguf_blocks(EngineConfig(gguf_blocks=True, tensor_parallel_size=2))
