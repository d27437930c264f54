"""The native CPU prefill attention (cpu_kernel.cc) against the naive float64
oracle and the jnp dense path: the dense path's mixes and head ratios, page
sizes that do and do not divide a key chunk, windows over released (NaN
trash) pages, soft caps, and the rows it must leave exactly zero."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native
from pallas_kernels.ragged_paged_attention import cpu, dense
from tests.helpers import kernel_cases as kc
from tests.helpers.rpa_cases import make_case, naive_attention
from tests.pallas_kernels.test_dense import T_STEP, _case

if not cpu.available():
    pytest.skip(
        f"native CPU attention unavailable: {native.unavailable('rpa_cpu')}",
        allow_module_level=True,
    )


def _release_behind_window(case, q_lens, kv_lens, window, page_size):
    """Point every page wholly behind all of a sequence's windows at the
    trash page 0, filled with NaN, as the engine hands such pages back."""
    case["k_pages"][:, 0] = np.nan
    case["v_pages"][:, 0] = np.nan
    for s, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        for j in range(case["block_tables"].shape[1]):
            if (j + 1) * page_size <= kv - q - window + 1:
                case["block_tables"][s, j] = 0


def _run(case, **kw):
    out, served = jax.jit(lambda c: cpu.dense_prefill(**c, **kw))(
        {k: jnp.asarray(v) for k, v in case.items()}
    )
    return np.asarray(out, np.float64), np.asarray(served)


def _served(q_lens, T=T_STEP):
    rows = np.repeat(np.arange(len(q_lens)), q_lens)
    want = np.zeros(T, bool)
    want[: len(rows)] = np.asarray(q_lens)[rows] > 1
    return want


def _check(case, q_lens, **kw):
    got, served = _run(case, **kw)
    want = naive_attention(**case, **kw)
    want[~served] = 0.0  # decode rows are the decode path's
    np.testing.assert_array_equal(served, _served(q_lens, case["q"].shape[0]))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[~served], 0.0)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


MIXES = [
    # (q_lens, kv_lens)
    ([150, 1, 70, 1, 0], [150, 300, 333, 17, 5]),  # fresh prompt, decodes, chunk after context
    ([65, 63, 64, 129], [65, 200, 64, 700]),  # partial query blocks
    ([2, 1, 300], [2, 1, 1200]),  # two-row chunk, a long context of many key chunks
]


@pytest.mark.parametrize("q_lens,kv_lens", MIXES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_matches_the_oracle(q_lens, kv_lens, heads, kv_heads):
    case = _case(len(q_lens) + heads, q_lens, kv_lens, heads=heads, kv_heads=kv_heads)
    _check(case, q_lens, sm_scale=0.25)


@pytest.mark.parametrize("page_size,head_dim", [(16, 64), (16, 128), (24, 64)])
def test_page_sizes_and_head_dims(page_size, head_dim):
    """24 divides no key chunk: chunks and query blocks start mid-page."""
    q_lens, kv_lens = [200, 1, 150], [1100, 50, 150]
    case = _case(
        page_size + head_dim,
        q_lens,
        kv_lens,
        heads=9,
        kv_heads=3,
        page_size=page_size,
        head_dim=head_dim,
    )
    _check(case, q_lens, sm_scale=head_dim**-0.5)


@pytest.mark.parametrize("window,cap", [(40, None), (100, None), (None, 3.0), (600, 2.0)])
def test_windows_and_soft_caps(window, cap):
    """With a window the pages wholly behind every row's window go back to
    the NaN trash page: nothing may read them."""
    q_lens, kv_lens = [200, 1, 90], [900, 400, 90]
    case = _case(3, q_lens, kv_lens, page_size=16)
    kw = dict(sm_scale=0.3, sliding_window=window, soft_cap=cap)
    want = naive_attention(**case, **kw)
    if window is not None:
        _release_behind_window(case, q_lens, kv_lens, window, 16)
    got, served = _run(case, **kw)
    want[~served] = 0.0
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_no_live_sequences_and_only_decodes():
    case = _case(1, [1, 1, 1], [10, 20, 30])
    got, served = _run(case, sm_scale=0.25)
    assert not served.any() and (got == 0).all()
    case["num_seqs"] = np.int32(0)
    got, served = _run(case, sm_scale=0.25)
    assert not served.any() and (got == 0).all()


def test_served_mask_equals_the_dense_paths():
    q_lens, kv_lens = MIXES[0]
    args = {k: jnp.asarray(v) for k, v in _case(0, q_lens, kv_lens).items()}
    _, served = cpu.dense_prefill(**args, sm_scale=0.25)
    _, want = dense.dense_prefill(**args, block_q=64, sm_scale=0.25)
    np.testing.assert_array_equal(np.asarray(served), np.asarray(want))


def test_lone_prompt_equals_the_dense_path():
    rng = np.random.default_rng(7)
    case = make_case(
        rng, q_lens=[1024], kv_lens=[1024], num_heads=9, num_kv_heads=3, head_dim=64, page_size=16
    )
    args = {k: jnp.asarray(v) for k, v in case.items()}
    got, _ = cpu.dense_prefill(**args, sm_scale=0.125)
    want, _ = dense.dense_prefill(**args, block_q=512, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_int8_pages_without_scales_are_refused():
    case = {k: jnp.asarray(v) for k, v in _case(2, [40], [40]).items()}
    case["k_pages"] = case["k_pages"].astype(jnp.int8)
    case["v_pages"] = case["v_pages"].astype(jnp.int8)
    with pytest.raises(ValueError, match="int8 pages need k_scale"):
        cpu.dense_prefill(**case, sm_scale=0.25)


# ---- cpu.ragged_paged_attention: every live row, decodes included ----


def _ragged_case(
    seed,
    q_lens,
    kv_lens,
    *,
    heads=6,
    kv_heads=2,
    page_size=8,
    head_dim=16,
    pad_tokens=5,
    pad_seqs=2,
    **kw,
):
    rng = np.random.default_rng(seed)
    return make_case(
        rng,
        q_lens=q_lens,
        kv_lens=kv_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        pad_tokens=pad_tokens,
        pad_seqs=pad_seqs,
        **kw,
    )


def _ragged(case, **kw):
    out = jax.jit(lambda c: cpu.ragged_paged_attention(**c, **kw))(
        {k: jnp.asarray(v) for k, v in case.items()}
    )
    return np.asarray(out, np.float64)


def _check_ragged(case, q_lens, **kw):
    want = naive_attention(**case, **kw)
    got = _ragged(case, **kw)
    assert np.isfinite(got).all()
    live = np.zeros(case["q"].shape[0], bool)
    live[: sum(q_lens)] = np.repeat(np.asarray(q_lens) > 0, q_lens)
    np.testing.assert_array_equal(got[~live], 0.0)  # padding rows
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def _decode_lens(n, page_size):
    pool = [1, page_size - 1, page_size, page_size + 1, 700, 37]
    return [pool[i % len(pool)] for i in range(n)]


@pytest.mark.parametrize("n", [1, 7, 16])
@pytest.mark.parametrize("page_size", [8, 16])
def test_ragged_all_decodes(n, page_size):
    kv_lens = _decode_lens(n, page_size)
    case = _ragged_case(n + page_size, [1] * n, kv_lens, page_size=page_size)
    _check_ragged(case, [1] * n, sm_scale=0.25)


RAGGED_MIXES = [
    # (q_lens, kv_lens)
    ([150, 1, 70, 1, 0], [150, 300, 333, 17, 5]),  # prompt, decodes, chunk, a q_len 0 sequence
    ([1, 0, 1, 65, 1], [9, 0, 700, 129, 1]),  # decodes around a chunk, kv_len 1, q_len 0
    ([2, 1, 1, 1], [2, 16, 15, 17]),  # two-row chunk, decodes at page edges
]


@pytest.mark.parametrize("q_lens,kv_lens", RAGGED_MIXES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_ragged_mixes(q_lens, kv_lens, heads, kv_heads):
    case = _ragged_case(len(q_lens) + heads, q_lens, kv_lens, heads=heads, kv_heads=kv_heads)
    _check_ragged(case, q_lens, sm_scale=0.25)


@pytest.mark.parametrize("page_size,head_dim", [(16, 64), (16, 128), (8, 64), (8, 40)])
def test_ragged_page_sizes_and_head_dims(page_size, head_dim):
    """40 is no multiple of 16: the decode path's scalar loops."""
    q_lens, kv_lens = [1, 40, 1, 1], [1100, 40, page_size + 1, 3]
    case = _ragged_case(
        page_size + head_dim,
        q_lens,
        kv_lens,
        heads=9,
        kv_heads=3,
        page_size=page_size,
        head_dim=head_dim,
    )
    _check_ragged(case, q_lens, sm_scale=head_dim**-0.5)


@pytest.mark.parametrize("window,cap", [(7, None), (40, None), (None, 3.0), (100, 2.0)])
def test_ragged_windows_and_soft_caps(window, cap):
    """Pages wholly behind every row's window go back to the NaN trash page."""
    q_lens, kv_lens = [1, 60, 1, 1, 1], [900, 90, 400, 5, 33]
    case = _ragged_case(5, q_lens, kv_lens, page_size=16)
    kw = dict(sm_scale=0.3, sliding_window=window, soft_cap=cap)
    want = naive_attention(**case, **kw)
    if window is not None:
        _release_behind_window(case, q_lens, kv_lens, window, 16)
    got = _ragged(case, **kw)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[sum(q_lens) :], 0.0)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_ragged_dead_sequences_are_zero():
    """Sequences at or past num_seqs, and decodes with kv_len 0, leave zeros."""
    case = _ragged_case(1, [1, 1, 30], [10, 20, 30])
    case["num_seqs"] = np.int32(1)
    got = _ragged(case, sm_scale=0.25)
    want = naive_attention(**case, sm_scale=0.25)
    assert (got[1:] == 0).all() and (got[0] != 0).any()
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    case["num_seqs"] = np.int32(0)
    assert (_ragged(case, sm_scale=0.25) == 0).all()
    case = _ragged_case(2, [1, 1], [5, 20])
    case["kv_lens"][0] = 0
    case["k_pages"][:, case["block_tables"][0, 0]] = np.nan
    case["v_pages"][:, case["block_tables"][0, 0]] = np.nan
    got = _ragged(case, sm_scale=0.25)
    assert (got[0] == 0).all() and np.isfinite(got).all()
    np.testing.assert_allclose(got, naive_attention(**case, sm_scale=0.25), atol=2e-5, rtol=2e-5)


def test_ragged_prefill_rows_equal_dense_prefill():
    q_lens, kv_lens = MIXES[0]
    args = {k: jnp.asarray(v) for k, v in _case(0, q_lens, kv_lens).items()}
    got = np.asarray(cpu.ragged_paged_attention(**args, sm_scale=0.25))
    want, served = cpu.dense_prefill(**args, sm_scale=0.25)
    served = np.asarray(served)
    np.testing.assert_array_equal(got[served], np.asarray(want)[served])
    assert (got[~served][: sum(q_lens)] != 0).any()  # the decode rows are served too


def test_ragged_unread_page_dtypes_are_refused():
    case = {k: jnp.asarray(v) for k, v in _ragged_case(2, [1], [40]).items()}
    case["k_pages"] = case["v_pages"] = case["k_pages"].astype(jnp.int16)
    with pytest.raises(ValueError, match="does not read int16"):
        cpu.ragged_paged_attention(**case, sm_scale=0.25)


# ---- page formats (kv_formats): every format the engine stores ----

FORMATS = [
    kc.Config("float32", 64, 8, 8, 1, sliding_window=24, int8=True),
    kc.Config("bfloat16", 128, 16, 6, 2),
    *kc.FORMAT_CONFIGS,
]


@pytest.mark.parametrize("cfg", FORMATS, ids=lambda c: c.id)
def test_ragged_reads_every_page_format(cfg):
    """int8 / int4 (NaN scales in unwritten slots), fp8 and bfloat16 pages
    against the reference and the float64 oracle on exactly their values."""
    kc.check_against_reference_and_oracle(
        lambda args, **kw: cpu.ragged_paged_attention(**args, **kw), cfg
    )


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_e4m3"])
def test_dense_prefill_reads_quantized_pages(fmt):
    """Long prefill chunks (the gathered key tiles) over quantized pages."""
    q_lens, kv_lens = [200, 1, 150], [1100, 50, 150]
    case = kc.quantize(
        _case(11, q_lens, kv_lens, heads=9, kv_heads=3, page_size=16, head_dim=64), 3, fmt
    )
    args = {k: jnp.asarray(v) for k, v in case.items()}
    got, served = cpu.dense_prefill(**args, sm_scale=0.125)
    served = np.asarray(served)
    want = kc.oracle(case, sm_scale=0.125)
    want[~served] = 0.0
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=3e-5, rtol=3e-5)
