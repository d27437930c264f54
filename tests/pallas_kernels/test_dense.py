"""The dense causal-block prefill path (long prompt chunks on CPU) against the
naive float64 oracle: blocks that spill into the next sequence, decodes and
empty sequences riding along, key chunks across pages, windows (with pages
released to a NaN trash page), sinks, soft caps and int8 pages."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import dense
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention
from tests.helpers.rpa_cases import make_case, naive_attention

T_STEP, S_STEP = 384, 6  # 64 rows per sequence slot: the dense path's block is 64


def _case(seed, q_lens, kv_lens, *, heads=6, kv_heads=2, page_size=8, head_dim=16, **kw):
    rng = np.random.default_rng(seed)
    return make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pad_tokens=T_STEP - sum(q_lens),
        pad_seqs=S_STEP - len(q_lens),
        **kw,
    )


def _run(case, **kw):
    args = {k: jnp.asarray(v) for k, v in case.items()}
    return np.asarray(ragged_paged_attention(**args, **kw, all_decode=False), np.float64)


def test_the_step_shapes_take_the_dense_path():
    assert dense.use_dense(T_STEP, S_STEP) and not dense.use_dense(96, 12)
    assert dense.dense_block(T_STEP, S_STEP) == 64
    assert [dense.dense_block(t, 1) for t in (64, 512, 4096)] == [64, 512, 512]


MIXES = [
    # (q_lens, kv_lens)
    ([150, 1, 70, 1, 0], [150, 300, 333, 17, 5]),  # fresh prompt, decodes, chunk after context
    ([65, 63, 64, 129], [65, 200, 64, 700]),  # blocks of 64 +- 1: partial blocks spill
    ([2, 1, 300], [2, 1, 1200]),  # two-row chunk, a long context of many key chunks
]


@pytest.mark.parametrize("q_lens,kv_lens", MIXES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_dense_matches_the_oracle(q_lens, kv_lens, heads, kv_heads):
    case = _case(len(q_lens) + heads, q_lens, kv_lens, heads=heads, kv_heads=kv_heads)
    got = _run(case, sm_scale=0.25)
    want = naive_attention(**case, sm_scale=0.25)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[sum(q_lens) :], 0.0)  # padding rows
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_dense_serves_only_multi_row_sequences():
    q_lens, kv_lens = MIXES[0]
    case = {k: jnp.asarray(v) for k, v in _case(0, q_lens, kv_lens).items()}
    out, served = dense.dense_prefill(**case, block_q=64, sm_scale=0.25)
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    want = np.zeros(T_STEP, bool)
    want[: len(rows)] = np.asarray(q_lens)[rows] > 1
    np.testing.assert_array_equal(np.asarray(served), want)
    assert (np.asarray(out)[~want] == 0).all()


@pytest.mark.parametrize(
    "window,sinks,cap", [(40, 0, None), (100, 4, None), (None, 0, 3.0), (600, 0, 2.0)]
)
def test_dense_windows_sinks_and_caps(window, sinks, cap):
    """With a window (and no sinks) the pages wholly behind every row's
    window go back to the NaN trash page: nothing may read them."""
    q_lens, kv_lens = [200, 1, 90], [900, 400, 90]
    case = _case(3, q_lens, kv_lens, page_size=16)
    kw = dict(sm_scale=0.3, sliding_window=window, soft_cap=cap, num_sink_tokens=sinks)
    want = naive_attention(**case, **kw)
    if window is not None:
        ps = 16
        case["k_pages"][:, 0] = np.nan
        case["v_pages"][:, 0] = np.nan
        for s, (q, kv) in enumerate(zip(q_lens, kv_lens)):
            oldest = kv - q - window + 1
            for j in range(case["block_tables"].shape[1]):
                if j * ps >= sinks and (j + 1) * ps <= oldest:
                    case["block_tables"][s, j] = 0
    got = _run(case, **kw)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_dense_int8_pages():
    rng = np.random.default_rng(9)
    case = _case(9, [120, 1, 40], [250, 33, 40], nan_fill=False)
    KVH, P, ps, D = case["k_pages"].shape
    for name in ("k", "v"):
        case[f"{name}_pages"] = rng.integers(-127, 128, (KVH, P, ps, D)).astype(np.int8)
    ks, vs = (rng.uniform(0.001, 0.02, (KVH, P, ps)).astype(np.float32) for _ in range(2))
    got = _run(case, sm_scale=0.3, k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
    want = naive_attention(**case, sm_scale=0.3, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
