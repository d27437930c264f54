"""A tied embedding kept in its GGUF Q8_0 blocks (jaxkv.model.q8): its rows
against the gguf library's dequantization, its head (native and XLA)
against a float64 product, and an engine whose tied embedding stays in
blocks against the same engine on float32 weights."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from jaxkv.model import blocks, q8

pytestmark = pytest.mark.skipif(not blocks.available(), reason="native CPU kernels unavailable")


def test_rows_and_head_read_the_blocks_as_the_gguf_library_dequantizes_them(monkeypatch):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(1)
    w = rng.standard_normal((700, 96)).astype(np.float32)  # pieces of 128 rows, a ragged last
    raw = quantize(w, Q.Q8_0)
    ref = dequantize(raw, Q.Q8_0).reshape(w.shape)
    table = q8.Q8Table(q8.Q8Blocks(raw, w.shape))
    assert table.shape == (700, 96)
    ids = jnp.asarray([0, 699, 5, 5, 321])
    np.testing.assert_array_equal(np.asarray(table.rows(ids, jnp.float32)), ref[np.asarray(ids)])
    from tests.model.test_blocks import q8_rows

    for rounded in (True, False):  # JAXKV_GGUF_ROUND_X: h rounded at <= INT_ROWS rows, or exact
        monkeypatch.setenv("JAXKV_GGUF_ROUND_X", "1" if rounded else "0")
        for rows in (1, 3, 8, 9, 33, 64, 65):
            h = rng.standard_normal((rows, 96)).astype(np.float32)
            exact = h.astype(np.float64) @ ref.astype(np.float64).T
            native_want = (
                q8_rows(h) @ ref.astype(np.float64).T
                if rounded and rows <= blocks.INT_ROWS
                else exact
            )
            for native, want in ((True, native_want), (False, exact)):
                got = jax.jit(lambda h, n=native: table.head(h, n))(jnp.asarray(h))
                np.testing.assert_allclose(
                    np.asarray(got), want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=str(rows)
                )
    with pytest.raises(ValueError, match="Q8Blocks"):
        q8.Q8Blocks(raw[:, :40], (700, 96))


def test_an_engine_on_q8_blocks_gives_the_float32_engines_tokens(tmp_path, monkeypatch):
    from checkpoints.loader import load_model

    # The blocks read exactly (x in float32; the integer path's rounding of x
    # flips near-tie tokens of this random model: tests/model/test_blocks.py).
    monkeypatch.setenv("JAXKV_GGUF_ROUND_X", "0")
    from tests.checkpoints.test_gguf_io import write_gguf
    from tests.helpers.model_utils import greedy_runs

    path = tmp_path / "tied.gguf"
    write_gguf(path, arch="qwen2", tied=True)  # token_embd as Q8_0
    prompts = [[1, 5, 9, 2], [7] * 11, list(range(3, 30))]
    runs = {}
    for kept in (True, False):
        module, tok = load_model(str(path), gguf_blocks=kept)
        assert isinstance(module.embed, q8.Q8Table) == kept
        runs[kept] = greedy_runs(module, tok, prompts)
    for (tb, lb), (tf, lf) in zip(runs[True], runs[False]):
        assert tb == tf
        np.testing.assert_allclose(lb, lf, atol=1e-4)
