"""The reference ragged paged attention against hand-computed cases and a
naive per-query loop."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention
from tests.helpers.rpa_cases import make_case, naive_attention


def _run(case, **kw):
    args = {k: jnp.asarray(v) for k, v in case.items()}
    return np.asarray(ragged_paged_attention(**args, **kw), np.float64)


def test_hand_computed_single_key_and_two_keys():
    # One head, D=2, page_size 2. Seq 0: one key -> output is exactly its value.
    # Seq 1: two keys with scores 0 and log(3) -> weights 1/4, 3/4.
    k_pages = np.full((1, 3, 2, 2), np.nan, np.float32)
    v_pages = np.full((1, 3, 2, 2), np.nan, np.float32)
    k_pages[0, 2, 0] = [0.0, 0.0]
    v_pages[0, 2, 0] = [5.0, -1.0]
    k_pages[0, 1, 0] = [0.0, 0.0]
    k_pages[0, 1, 1] = [np.log(3.0), 0.0]
    v_pages[0, 1, 0] = [4.0, 0.0]
    v_pages[0, 1, 1] = [0.0, 8.0]
    q = np.array([[[1.0, 7.0]], [[1.0, 0.0]], [[9.0, 9.0]]], np.float32)  # row 2 is padding
    out = _run(
        dict(
            q=q,
            k_pages=k_pages,
            v_pages=v_pages,
            kv_lens=np.array([1, 2], np.int32),
            block_tables=np.array([[2], [1]], np.int32),
            cu_q_lens=np.array([0, 1, 2], np.int32),
            num_seqs=np.int32(2),
        ),
        sm_scale=1.0,
    )
    np.testing.assert_allclose(out[0, 0], [5.0, -1.0], rtol=1e-6)
    np.testing.assert_allclose(out[1, 0], [1.0, 6.0], rtol=1e-6)
    np.testing.assert_array_equal(out[2], 0.0)


def test_hand_computed_causal_prefill():
    # A 2-token prefill: the first query sees only key 0, the second both.
    k_pages = np.zeros((1, 2, 4, 1), np.float32)
    v_pages = np.zeros((1, 2, 4, 1), np.float32)
    v_pages[0, 1, :2, 0] = [2.0, 6.0]
    k_pages[0, 1, 2:] = np.nan
    v_pages[0, 1, 2:] = np.nan
    q = np.ones((2, 1, 1), np.float32)
    out = _run(
        dict(
            q=q,
            k_pages=k_pages,
            v_pages=v_pages,
            kv_lens=np.array([2], np.int32),
            block_tables=np.array([[1]], np.int32),
            cu_q_lens=np.array([0, 2], np.int32),
            num_seqs=np.int32(1),
        ),
        sm_scale=1.0,
    )
    np.testing.assert_allclose(out[:, 0, 0], [2.0, 4.0], rtol=1e-6)


CASES = [
    # (q_lens, kv_lens)
    ([1, 1, 1], [1, 17, 40]),  # decodes only
    ([5, 1, 16], [5, 9, 40]),  # fresh prefill, decode, chunk after cached context
    ([33, 1], [50, 16]),  # page-crossing chunk
    ([0, 3, 1], [7, 3, 15]),  # a sequence with nothing this step
]


@pytest.mark.parametrize("q_lens,kv_lens", CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("window,cap", [(None, None), (6, None), (None, 5.0)])
def test_reference_matches_naive(q_lens, kv_lens, heads, kv_heads, window, cap):
    rng = np.random.default_rng(len(q_lens) * 100 + heads)
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=16,
        page_size=8,
        pad_tokens=3,
        pad_seqs=2,
    )
    kw = dict(sm_scale=0.25, sliding_window=window, soft_cap=cap)
    got = _run(case, **kw)
    want = naive_attention(**case, **kw)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_reference_int8_scales():
    rng = np.random.default_rng(7)
    case = make_case(
        rng,
        q_lens=[4, 1],
        kv_lens=[4, 21],
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        page_size=8,
        nan_fill=False,
    )
    KVH, P, ps, D = case["k_pages"].shape
    k8 = rng.integers(-127, 128, (KVH, P, ps, D)).astype(np.int8)
    v8 = rng.integers(-127, 128, (KVH, P, ps, D)).astype(np.int8)
    ks = rng.uniform(0.001, 0.02, (KVH, P, ps)).astype(np.float32)
    vs = rng.uniform(0.001, 0.02, (KVH, P, ps)).astype(np.float32)
    case.update(k_pages=k8, v_pages=v8)
    kw = dict(sm_scale=0.3)
    got = _run({**case}, k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs), **kw)
    want = naive_attention(**case, k_scale=ks, v_scale=vs, **kw)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_reference_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    case = make_case(
        rng, q_lens=[1], kv_lens=[3], num_heads=6, num_kv_heads=4, head_dim=8, page_size=4
    )
    with pytest.raises(ValueError, match="multiple"):
        _run(case, sm_scale=1.0)


@pytest.mark.parametrize("sinks", [0, 3])
def test_reference_window_with_released_pages_and_sinks(sinks):
    """Pages wholly before every query's window (and past the sink tokens)
    handed back to the trash page, which is NaN: the output must not change."""
    rng = np.random.default_rng(11)
    ps, window = 8, 10
    case = make_case(
        rng, q_lens=[1, 4], kv_lens=[45, 38], num_heads=4, num_kv_heads=2, head_dim=16, page_size=ps
    )
    kw = dict(sm_scale=0.3, sliding_window=window, num_sink_tokens=sinks)
    want = naive_attention(**case, **kw)
    released = {k: v.copy() for k, v in case.items()}
    released["k_pages"][:, 0] = np.nan
    released["v_pages"][:, 0] = np.nan
    for s, (q_len, kv_len) in enumerate([(1, 45), (4, 38)]):
        oldest = kv_len - q_len - window + 1
        for j in range(released["block_tables"].shape[1]):
            if j * ps >= sinks and (j + 1) * ps <= oldest:
                released["block_tables"][s, j] = 0
    assert (released["block_tables"] == 0).sum() >= 4
    got = _run(released, **kw)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 40])
def test_reference_long_context_spans_several_key_chunks(window):
    """Contexts of several 128-key chunks (page size 8: 16 pages a chunk),
    prefill chunks whose queries stop in different chunks, and with a window
    the chunks wholly behind it released to the NaN trash page: the prefill
    path's loop must start, stop and carry its softmax right."""
    rng = np.random.default_rng(5)
    ps = 8
    # with the window, every query's oldest key is past the first chunk
    q_lens, kv_lens = [20, 1, 64, 30], [300, 260, 250, 290]
    case = make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        page_size=ps,
        pad_tokens=5,
        pad_seqs=1,
    )
    kw = dict(sm_scale=0.25, sliding_window=window)
    want = naive_attention(**case, **kw)
    if window is not None:
        case["k_pages"][:, 0] = np.nan
        case["v_pages"][:, 0] = np.nan
        for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            oldest = kv_len - q_len - window + 1
            for j in range(case["block_tables"].shape[1]):
                if (j + 1) * ps <= oldest:
                    case["block_tables"][s, j] = 0
        assert (case["block_tables"] == 0).sum() >= 40
    got = _run(case, **kw)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fmt,dtype", [("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_fp8_from_bits_decodes_every_finite_code(fmt, dtype):
    """The integer-only fp8 decode some kernels use, against ml_dtypes' own
    conversion of all 256 codes (NaN / inf codes excluded: never stored)."""
    import ml_dtypes

    from pallas_kernels.ragged_paged_attention.kv_formats import fp8_from_bits

    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(getattr(ml_dtypes, dtype)).astype(np.float64)
    got = np.asarray(fp8_from_bits(jnp.asarray(codes), fmt), np.float64)
    finite = np.isfinite(want)
    assert finite.sum() >= 240
    np.testing.assert_array_equal(got[finite], want[finite])
