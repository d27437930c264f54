"""Learned attention sinks (gpt-oss; `sinks.py`): a float64 oracle written
the way Hugging Face's GptOss eager attention computes them (scaled, capped,
masked scores; the sink logit concatenated as one more column; softmax; the
column dropped) checks the reference on hand-computed cases, then every
kernel (native CPU, Pallas TPU / Triton / Mosaic GPU in interpret mode) is
checked against the reference and the oracle on the kernel test batches
(NaN in unused pages, decodes and prefill rows, padding, a row with no key
to see), and bad sinks are refused by name. The TPU compile and the CUDA
lowerings with sinks are in test_lowering.py / test_mosaic_gpu_kernel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels
from pallas_kernels.ragged_paged_attention import cpu, gpu, mosaic_gpu, reference, tpu
from tests.helpers import kernel_cases as kc
from tests.helpers.rpa_cases import make_case, naive_attention
from tests.pallas_kernels.test_dense import T_STEP
from tests.pallas_kernels.test_dense import _case as dense_case

# Per-head sink logits, cycled over the heads: ordinary values, one that
# outweighs every score (6), one that swallows its rows (1e4: output ~0)
# and one that is no sink at all (-1e4).
PATTERN = (1.5, -0.7, 6.0, 1e4, -1e4, 3.0, 0.0, -2.5)


def pattern_sinks(num_heads):
    return np.array([PATTERN[h % len(PATTERN)] for h in range(num_heads)], np.float32)


def sink_oracle(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sinks,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    k_scale=None,
    v_scale=None,
):
    """Per (sequence, head), in float64: scores = q k^T * sm_scale, soft
    capped, -inf where masked (causal, window); the head's sink logit as a
    last column; softmax over the row; that column dropped; times V."""
    q = np.asarray(q, np.float64)
    kp, vp = np.asarray(k_pages, np.float64), np.asarray(v_pages, np.float64)
    if k_scale is not None:
        kp = kp * np.asarray(k_scale, np.float64)[..., None]
        vp = vp * np.asarray(v_scale, np.float64)[..., None]
    sinks = np.asarray(sinks, np.float64)
    T, H, D = q.shape
    page_size = kp.shape[2]
    G = H // kp.shape[0]
    out = np.zeros((T, H, D))
    for s in range(int(num_seqs)):
        kv_len, start, end = int(kv_lens[s]), int(cu_q_lens[s]), int(cu_q_lens[s + 1])
        key_pos = np.arange(kv_len)
        pages, slots = block_tables[s, key_pos // page_size], key_pos % page_size
        keys, values = kp[:, pages, slots], vp[:, pages, slots]  # [KVH, kv_len, D]
        q_pos = kv_len - (end - start) + np.arange(end - start)
        seen = key_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            seen &= key_pos[None, :] > q_pos[:, None] - sliding_window
        for h in range(H):
            scores = q[start:end, h] @ keys[h // G].T * sm_scale
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            scores = np.where(seen, scores, -np.inf)
            logits = np.concatenate([scores, np.full((end - start, 1), sinks[h])], axis=1)
            probs = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs /= probs.sum(axis=1, keepdims=True)
            out[start:end, h] = probs[:, :-1] @ values[h // G]
    return out


def _ref(case, **kw):
    args = {k: jnp.asarray(v) for k, v in case.items()}
    return np.asarray(reference.ragged_paged_attention(**args, **kw), np.float64)


# ---- the reference against hand-computed numbers and the oracle ----


def _one_key_case(q_rows, keys, values, kv_len=None):
    """One sequence, KV head 1, D = 2, page size 4: its keys / values in page 1,
    the rest of the pages NaN; q_rows [rows, H, 2] (rows = q_len)."""
    kp = np.full((1, 2, 4, 2), np.nan, np.float32)
    vp = np.full((1, 2, 4, 2), np.nan, np.float32)
    if len(keys):
        kp[0, 1, : len(keys)], vp[0, 1, : len(values)] = keys, values
    q = np.asarray(q_rows, np.float32)
    return dict(
        q=q,
        k_pages=kp,
        v_pages=vp,
        kv_lens=np.array([len(keys) if kv_len is None else kv_len], np.int32),
        block_tables=np.array([[1]], np.int32),
        cu_q_lens=np.array([0, q.shape[0]], np.int32),
        num_seqs=np.int32(1),
    )


def test_hand_computed_sink_is_neither_scaled_nor_capped():
    # One key k = [1, 0], v = [4, -8]. Head 0: score 0.5 * 2 ln 3 = ln 3 against
    # a sink of ln 3 -> weight 1/2. Head 1: score 0 against a sink of -ln 3 ->
    # weight 3/4. Scaling the sink by sm_scale would give 0.63 and 0.70.
    case = _one_key_case([[[2 * np.log(3.0), 0.0], [0.0, 5.0]]], [[1.0, 0.0]], [[4.0, -8.0]])
    sinks = jnp.array([np.log(3.0), -np.log(3.0)], jnp.float32)
    out = _ref(case, sm_scale=0.5, sinks=sinks)
    np.testing.assert_allclose(out[0], [[2.0, -4.0], [3.0, -6.0]], rtol=1e-6)
    # Soft cap 1: head 0's score becomes tanh(ln 3) = 0.8, the sinks stay as
    # they are (capped, head 1's weight would be 0.69, not 3/4).
    out = _ref(case, sm_scale=0.5, soft_cap=1.0, sinks=sinks)
    w0 = np.exp(0.8) / (np.exp(0.8) + 3.0)
    np.testing.assert_allclose(out[0], [[4 * w0, -8 * w0], [3.0, -6.0]], rtol=1e-6)
    np.testing.assert_allclose(
        out, sink_oracle(**case, sinks=sinks, sm_scale=0.5, soft_cap=1.0), rtol=1e-6
    )


def test_hand_computed_causal_rows_and_a_row_with_no_key():
    # Two keys, scores 0 and ln 3, sink 0. Query 0 (position 0) sees key 0:
    # weight 1/2; query 1 sees both: weights 1/5, 3/5 (the sink takes 1/5).
    case = _one_key_case(
        [[[1.0, 0.0]], [[1.0, 0.0]]], [[0.0, 0.0], [np.log(3.0), 0.0]], [[5.0, 0.0], [0.0, 10.0]]
    )
    out = _ref(case, sm_scale=1.0, sinks=jnp.zeros(1, jnp.float32))
    np.testing.assert_allclose(out[:, 0], [[2.5, 0.0], [1.0, 6.0]], rtol=1e-6)
    # A decode before any key is written (kv_len 0): the sink takes everything.
    empty = _one_key_case([[[1.0, 0.0]]], [], [], kv_len=0)
    for sink in (0.0, -30.0, 30.0):
        out = _ref(empty, sm_scale=1.0, sinks=jnp.full(1, sink, jnp.float32))
        np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("window,cap", [(None, None), (6, 2.0)])
def test_reference_matches_the_oracle_with_extreme_sinks(window, cap):
    """Decodes, fresh and cached prefill chunks, GQA 4 (the blocked path;
    the decode and dense paths are checked below): sinks from 1e4 (rows ~0)
    to -1e4 (no sink: the plain softmax), and -inf is no sinks, bit for bit."""
    rng = np.random.default_rng(3)
    case = make_case(
        rng,
        q_lens=[1, 5, 12, 1],
        kv_lens=[17, 5, 40, 1],
        num_heads=8,
        num_kv_heads=2,
        head_dim=16,
        page_size=8,
        pad_tokens=3,
        pad_seqs=2,
    )
    kw = dict(sm_scale=0.25, sliding_window=window, soft_cap=cap)
    sinks = np.array([1e4, -1e4, 2.0, -3.0, 30.0, 0.5, -30.0, 8.0], np.float32)
    want = sink_oracle(**case, sinks=sinks, **kw)
    got = _ref(case, sinks=jnp.asarray(sinks), **kw)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(want[:, 0], 0.0, atol=1e-30)
    np.testing.assert_allclose(want[:, 1], naive_attention(**case, **kw)[:, 1], atol=1e-12)
    no_sinks = jnp.full(8, -jnp.inf, jnp.float32)
    np.testing.assert_array_equal(_ref(case, sinks=no_sinks, **kw), _ref(case, **kw))


@pytest.mark.parametrize("native", [False, True])
def test_dense_prefill_path_with_sinks(native):
    """The step shape of long chunks (dense blocks, decodes apart; with
    `native` the whole call in cpu_kernel.cc) with a window and sinks."""
    if native and not cpu.available():
        pytest.skip("native CPU attention unavailable")
    q_lens, kv_lens = [150, 1, 70, 1, 0], [150, 300, 333, 17, 5]
    case = dense_case(4, q_lens, kv_lens, heads=6, kv_heads=2)
    kw = dict(sm_scale=0.25, sliding_window=100, soft_cap=4.0)
    sinks = pattern_sinks(6)
    got = _ref(case, sinks=jnp.asarray(sinks), all_decode=False, native_cpu=native, **kw)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[sum(q_lens) : T_STEP], 0.0)
    np.testing.assert_allclose(got, sink_oracle(**case, sinks=sinks, **kw), atol=2e-5, rtol=2e-5)


# ---- every kernel against the reference and the oracle ----


def _with_an_empty_decode(case):
    """The decode batch's first sequence (q_len 1, kv_len 1) with kv_len 0:
    its row sees no key (only the sink), and its page becomes unused (NaN)."""
    case = {k: np.array(v) for k, v in case.items()}
    page = case["block_tables"][0, 0]
    case["kv_lens"][0] = 0
    for name in ("k", "v"):
        if f"{name}_scale" in case:
            case[f"{name}_scale"][:, page] = np.nan
        else:
            case[f"{name}_pages"][:, page] = np.nan
    return case


def check_with_sinks(run, cfg):
    """run(args, sinks=..., **kw) on the mixed and the decode batch of `cfg`
    against the reference and the oracle, elementwise at the dtype's
    tolerance; the sinks must move the output well past that tolerance."""
    dtype = jnp.bfloat16 if cfg.dtype == "bfloat16" else np.float32
    atol, rtol = kc.tolerance(dtype)
    # In q's dtype, as a model keeps them (gpt-oss: bfloat16); the oracle
    # takes the values the kernel sees.
    sinks_in = jnp.asarray(pattern_sinks(cfg.num_heads), dtype)
    sinks = np.asarray(sinks_in.astype(jnp.float32))
    for kind, case, kw in kc.config_batches(cfg):
        if kind == "decode":
            case = _with_an_empty_decode(case)
        args = {k: jnp.asarray(v) for k, v in case.items()}
        got = np.asarray(run(args, sinks=sinks_in, **kw).astype(jnp.float32), np.float64)
        ref = np.asarray(
            reference.ragged_paged_attention(**args, sinks=sinks_in, **kw).astype(jnp.float32),
            np.float64,
        )
        want = sink_oracle(**case, sinks=sinks, **kw)
        assert np.abs(want - naive_attention(**case, **kw)).max() > 0.3  # the sinks matter
        np.testing.assert_allclose(ref, want, atol=atol, rtol=rtol, err_msg=f"{kind}: reference")
        assert np.isfinite(got).all(), f"{kind}: non-finite output"
        T_live = int(case["cu_q_lens"][int(case["num_seqs"])])
        np.testing.assert_array_equal(got[T_live:], 0.0, err_msg=f"{kind}: padding rows")
        if kind == "decode":
            np.testing.assert_array_equal(got[0], 0.0, err_msg="the row with no key")
        np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=f"{kind} vs oracle")
        np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol, err_msg=f"{kind} vs reference")


# Page sizes 8 / 16 / 32, GQA 3 / 8 / 1, head dims 64 / 128, window, cap,
# int8; the Mosaic GPU kernel takes the bfloat16 ones (and a twin of the first).
CONFIGS = [
    kc.Config("float32", 64, 8, 6, 2, sliding_window=24, soft_cap=5.0),
    kc.Config("bfloat16", 128, 16, 8, 1),
    kc.Config("float32", 64, 32, 4, 4, sliding_window=40, int8=True),
]
MOSAIC_CONFIGS = [CONFIGS[0]._replace(dtype="bfloat16"), CONFIGS[1]]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.id)
def test_tpu_kernel_with_sinks(cfg):
    check_with_sinks(
        lambda a, **kw: tpu.ragged_paged_attention(
            **a, **kw, interpret=pltpu.InterpretParams(), pages_per_block=4
        ),
        cfg,
    )


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.id)
def test_gpu_kernel_with_sinks(cfg):
    # 3 context splits for decodes: the sink joins the split merge, once.
    check_with_sinks(
        lambda a, **kw: gpu.ragged_paged_attention(**a, **kw, interpret=True, decode_splits=3), cfg
    )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cfg", MOSAIC_CONFIGS, ids=lambda c: c.id)
def test_mosaic_gpu_kernel_with_sinks(cfg):
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    gpu_callbacks.reset_gpu_interpret_mode_state()
    check_with_sinks(
        lambda a, **kw: mosaic_gpu.ragged_paged_attention(**a, **kw, interpret=True), cfg
    )


def test_native_cpu_kernel_with_sinks():
    """cpu_kernel.cc through the CPU "auto" entry: sinks must not send the
    call back to jnp (the native custom call is in the program)."""
    if not cpu.available():
        pytest.skip("native CPU attention unavailable")
    run = lambda a, **kw: pallas_kernels.ragged_paged_attention(**a, **kw)
    check_with_sinks(run, CONFIGS[0])
    (_, case, kw), _ = kc.config_batches(CONFIGS[0])
    args = {k: jnp.asarray(v) for k, v in case.items()}
    sinks = jnp.asarray(pattern_sinks(6))
    assert "jaxkv_rpa_ragged" in str(jax.make_jaxpr(lambda a: run(a, sinks=sinks, **kw))(args))


# ---- bad sinks are refused by name ----


@pytest.mark.parametrize(
    "sinks,match",
    [
        (np.zeros(5, np.float32), r"sinks must be \[H\] = \[6\]"),
        (np.zeros((6, 1), np.float32), r"sinks must be \[H\] = \[6\]"),
        (np.zeros(6, np.int32), "sinks must be a floating array"),
        ([0.0] * 6, "sinks must be None or a floating array"),
    ],
)
@pytest.mark.parametrize("impl", ["reference", "native", "tpu", "gpu", "mosaic_gpu"])
def test_bad_sinks_are_refused(impl, sinks, match):
    H, KVH, D, ps = 6, 2, 64, 16
    dtype = jnp.bfloat16 if impl == "mosaic_gpu" else jnp.float32
    q, pages = jnp.zeros((8, H, D), dtype), jnp.zeros((KVH, 5, ps, D), dtype)
    meta = (
        jnp.ones(2, jnp.int32),
        jnp.ones((2, 3), jnp.int32),
        jnp.array([0, 1, 2], jnp.int32),
        jnp.int32(2),
    )
    fn = {
        "reference": reference.ragged_paged_attention,
        "native": cpu.ragged_paged_attention,
        "tpu": tpu.ragged_paged_attention,
        "gpu": gpu.ragged_paged_attention,
        "mosaic_gpu": mosaic_gpu.ragged_paged_attention,
    }[impl]
    if impl == "native" and not cpu.available():
        pytest.skip("native CPU attention unavailable")
    with pytest.raises(ValueError, match=match):
        fn(q, pages, pages, *meta, sm_scale=1.0, sinks=sinks)
