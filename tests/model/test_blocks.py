"""Layer matmul weights kept in their GGUF blocks (jaxkv.model.blocks): the
native matmul of each block type against a float64 product of the gguf
library's dequantization, on the register path (few rows) and the sgemm
path (many), and one-hot rows giving the dequantized values exactly; and
engines loading GGUFs whose layers mix kept and dequantized types (32-value
blocks; K-quant super-blocks) against the same engine on float32 weights."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from jaxkv.model import blocks

pytestmark = pytest.mark.skipif(not blocks.available(), reason="native CPU kernels unavailable")


K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
HALVES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of the fp16 d (dmin)


def k_blocks(rng, qtype, rows: int, cols: int, scale: float = 1e-2) -> np.ndarray:
    """Random valid K-quant rows [rows, cols / 256 * block bytes] (the gguf
    library cannot quantize K types): random bytes, fp16 d (and dmin) in
    [scale / 10, scale]."""
    values, nbytes = blocks.TYPES[qtype]
    raw = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    for off in HALVES[qtype]:
        d = rng.uniform(scale / 10, scale, (rows, cols // values, 1)).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


INT_PATH = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # at <= INT_ROWS rows: x rounded to int8, integer products


def q8_rows(x: np.ndarray) -> np.ndarray:
    """x [T, K] rounded as the native matmul's integer path rounds it, in
    numpy: per 32 values d = max|x| / 127, q = x * (127 / max|x|) rounded to
    nearest even (float32 arithmetic), as float64 values q d."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(b).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(b * inv)
    d = (amax / np.float32(127)).astype(np.float32)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, *K_TYPES], ids=lambda q: q.name)
def test_native_block_matmul_matches_a_float64_product(qtype):
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(int(qtype))
    rows, cols = 300, 96 if qtype not in K_TYPES else 768  # N % 8 == 4; 3 super-blocks
    if qtype in K_TYPES:
        bw = blocks.BlockWeight(k_blocks(rng, qtype, rows, cols), qtype, rows, cols, (cols, rows))
    else:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        bw = blocks.BlockWeight(quantize(w, qtype), qtype, rows, cols, (cols, rows))
        assert np.abs(bw.dequantize() - w).max() < 0.2 * np.abs(w).max()  # the blocks hold w
    ref = bw.dequantize().astype(np.float64)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    raw = jnp.asarray(bw.raw)
    # both paths: x as given (the default), and the integer path (JAXKV_GGUF_ROUND_X=1)
    for t, round_x in itertools.product((1, 3, 8, 17, 32, 33, 64, 65, 300), (False, True)):
        fn = jax.jit(lambda x, raw, r=round_x: blocks.matmul(x, raw, int(qtype), round_x=r))
        x = rng.standard_normal((t, cols)).astype(np.float32)
        # x rounded to int8 blocks of 32 first
        rounded = round_x and t <= blocks.INT_ROWS and qtype in INT_PATH
        want = (q8_rows(x) if rounded else x.astype(np.float64)) @ ref.T
        got = np.asarray(fn(jnp.asarray(x), raw))
        np.testing.assert_allclose(
            got, want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=str(t)
        )
        if rounded:  # and the rounding is what separates it from x's own product
            assert np.abs(got - x.astype(np.float64) @ ref.T).max() > 10 * np.abs(got - want).max()
        # One-hot rows pick columns of W: each value as the gguf library gives it
        # (exactly; through the int8 rounding of x, to a float32 rounding).
        cols_at = rng.choice(cols, t, replace=t > cols)
        got = np.asarray(fn(jnp.asarray(np.eye(cols, dtype=np.float32)[cols_at]), raw))
        if rounded:
            np.testing.assert_allclose(
                got, ref.T[cols_at], rtol=1e-6, atol=1e-6 * np.abs(ref).max(), err_msg=str(t)
            )
        else:
            np.testing.assert_array_equal(got, ref.T[cols_at].astype(np.float32), err_msg=str(t))


def test_a_block_weight_of_the_wrong_size_is_refused():
    from gguf.constants import GGML_QUANT_SIZES

    assert all(GGML_QUANT_SIZES[q] == size for q, size in blocks.TYPES.items())
    raw = np.zeros((4, 3 * 20), np.uint8)
    with pytest.raises(ValueError, match="Q4_1 rows of 96 values"):
        blocks.BlockWeight(raw[:, :50], Q.Q4_1, 4, 96, (96, 4))
    with pytest.raises(ValueError, match=r"Q4_K rows of 96 values \(a multiple of 256\)"):
        blocks.BlockWeight(np.zeros((4, 54), np.uint8), Q.Q4_K, 4, 96, (96, 4))
    assert blocks.readable(Q.Q6_K, 512) and not blocks.readable(Q.Q6_K, 640)
    assert not blocks.readable(Q.Q5_1, 64)


def same_tokens_close_logprobs(runs, rounded: bool = True):
    """Greedy tokens equal, log-probabilities within the effect of the
    integer path's rounding of x to int8 blocks of 32 (Q4_0 / Q4_1 / Q8_0
    layers and the tied Q8_0 head at <= INT_ROWS rows; the kernel itself is
    held to a float64 product of the rounded rows above). On these random
    64-wide models (two blocks of 32 per row: the rounding is coarser than
    in a real model's rows) most log-probabilities move by < 0.03 and a
    near-tie step by up to ~0.5 (the float32 path alone agreed to 1e-3).
    With `runs[False]` holding top-2 log-probabilities (`greedy_runs(top=2)`),
    a rounded run may leave the float32 run's tokens only where the float32
    run had a near tie (its two best within 0.1) and took the other of them;
    the answer is compared up to there."""
    diffs = []
    for (tb, lb, *_), (tf, lf, *top) in zip(runs[True], runs[False]):
        n = next((i for i, (a, b) in enumerate(zip(tb, tf)) if a != b), len(tf))
        if n < len(tf):
            assert rounded and top, (tb, tf)
            best = sorted(top[0][n].items(), key=lambda kv: -kv[1])[:2]
            assert tb[n] == best[1][0] and best[0][1] - best[1][1] < 0.1, (n, tb, tf, best)
        diffs += list(np.abs(np.asarray(lb[:n]) - np.asarray(lf[:n])))
    if not rounded:  # JAXKV_GGUF_ROUND_X=0: x stays float32, the blocks read exactly
        assert max(diffs) < 1e-3, diffs
    assert np.median(diffs) < 3e-2 and max(diffs) < 0.6, diffs


@pytest.mark.parametrize("rounded", [True, False], ids=["int8-x", "float-x"])
def test_an_engine_on_gguf_blocks_gives_the_float32_engines_tokens(tmp_path, monkeypatch, rounded):
    from checkpoints.loader import load_model

    monkeypatch.setenv("JAXKV_GGUF_ROUND_X", "1" if rounded else "0")
    from tests.checkpoints.test_gguf_io import write_gguf
    from tests.helpers.model_utils import greedy_runs

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
        runs[keep] = greedy_runs(module, tok, prompts, top=0 if keep else 2)
    same_tokens_close_logprobs(runs, rounded)
    with pytest.raises(ValueError, match="gguf_blocks and quantize"):
        load_model(str(path), gguf_blocks=True, quantize="int8")


def test_an_engine_on_k_quant_blocks_gives_the_float32_engines_tokens(tmp_path):
    from checkpoints.loader import load_model
    from tests.checkpoints.test_gguf_io import hf_weights, write_gguf
    from tests.helpers.model_utils import greedy_runs

    # Rows of E = 256 values (q, k, v, gate, up) as random K super-blocks; o
    # and down (64 and 96 values: no K type) stay Q4_1 (kept) and Q5_1.
    types = {
        "attn_q": Q.Q4_K,
        "attn_k": Q.Q6_K,
        "attn_v": Q.Q5_K,
        "ffn_gate": Q.Q6_K,
        "ffn_up": Q.Q4_K,
    }
    rng, weights, qtypes = np.random.default_rng(3), hf_weights("llama", True, E=256), {}
    for name in list(weights):
        if name.split(".")[-2] in types:
            qtypes[name] = types[name.split(".")[-2]]
            weights[name] = k_blocks(rng, qtypes[name], weights[name].shape[0], 256, scale=2e-3)
    path = tmp_path / "k_quants.gguf"
    write_gguf(path, arch="llama", tied=True, weights=weights, qtypes=qtypes, E=256)
    prompts = [[1, 5, 9, 2], list(range(3, 39))]
    runs = {}
    for keep in (True, False):
        module, tok = load_model(str(path), gguf_blocks=keep)
        attn, block = module.layers[1].attn, module.layers[1]
        kinds = (attn.wqkv.kinds, attn.wo.kinds, block.w_gate_up.kinds) if keep else None
        assert kinds in (
            None,
            (
                tuple(int(types[k]) for k in ("attn_q", "attn_k", "attn_v")),
                (int(Q.Q4_1),),
                (int(Q.Q6_K), int(Q.Q4_K)),
            ),
        )
        runs[keep] = greedy_runs(module, tok, prompts)
    same_tokens_close_logprobs(runs)


def test_blocks_are_refused_by_name_where_the_native_matmul_cannot_run_them():
    from jaxkv.config import EngineConfig

    # the default: kept for a GGUF source where the native matmul runs, else not
    assert blocks.keep_gguf_blocks(EngineConfig(), gguf_source=False) is False
    assert blocks.keep_gguf_blocks(EngineConfig(), gguf_source=True) is blocks.available()
    assert blocks.keep_gguf_blocks(EngineConfig(gguf_blocks=False)) is False
    assert blocks.keep_gguf_blocks(EngineConfig(dtype="bfloat16")) is False  # silently
    assert blocks.keep_gguf_blocks(EngineConfig(gguf_blocks=True)) is True
    with pytest.raises(ValueError, match="gguf_blocks: .* need dtype float32"):
        blocks.keep_gguf_blocks(EngineConfig(gguf_blocks=True, dtype="bfloat16"))
    with pytest.raises(ValueError, match="need one device"):
        blocks.keep_gguf_blocks(EngineConfig(gguf_blocks=True, tensor_parallel_size=2))
