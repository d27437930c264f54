"""The Pallas Triton GPU kernel run on CPU in interpret mode against the
reference and the naive float64 oracle, in every KV page format. Decode
batches take the flash-decoding path (context splits merged by
log-sum-exp), batches with prefill chunks the blocked-query path. The int4
and fp8 formats also lower for CUDA (the float and int8 ones:
test_lowering.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import gpu
from tests.helpers import kernel_cases as kc

# 3 context splits: uneven split sizes, empty splits for short sequences.
TEST_OPTIONS = dict(decode_splits=3)


def _runner(**options):
    def run(args, **kw):
        return gpu.ragged_paged_attention(**args, **kw, interpret=True, **options)

    return run


@pytest.mark.parametrize("cfg", kc.DEFAULT_CONFIGS, ids=lambda c: c.id)
def test_gpu_kernel_matches_reference_and_oracle(cfg):
    kc.check_against_reference_and_oracle(_runner(**TEST_OPTIONS), cfg)


@pytest.mark.parametrize("cfg", kc.FORMAT_CONFIGS, ids=lambda c: c.id)
def test_gpu_kernel_reads_int4_and_fp8_pages(cfg):
    kc.check_against_reference_and_oracle(_runner(**TEST_OPTIONS), cfg)


def test_gpu_kernel_default_splits_and_small_blocks():
    # Defaults: as many splits as fill a GPU (capped by KV blocks); 16-token KV
    # blocks (2 pages of 8) and 4-token query blocks for prefill.
    kc.check_against_reference_and_oracle(
        _runner(pages_per_block=2, prefill_block_q=4), kc.Config("float32", 64, 8, 6, 2)
    )


def test_gpu_kernel_one_split_equals_many():
    cfg = kc.Config("float32", 64, 16, 8, 1, sliding_window=40)
    _, (_, case, kw) = kc.config_batches(cfg)  # the decode batch
    args = {k: jnp.asarray(v) for k, v in case.items()}
    one = np.asarray(_runner(decode_splits=1)(args, **kw))
    many = np.asarray(_runner(decode_splits=7)(args, **kw))
    np.testing.assert_allclose(one, many, atol=3e-6, rtol=3e-6)


def test_gpu_kernel_no_sequences_gives_zeros():
    cfg = kc.DEFAULT_CONFIGS[0]  # same shapes and options: reuses that compile
    (_, case, kw), _ = kc.config_batches(cfg)
    args = {k: jnp.asarray(v) for k, v in case.items()}
    args["num_seqs"] = jnp.int32(0)
    np.testing.assert_array_equal(np.asarray(_runner(**TEST_OPTIONS)(args, **kw)), 0.0)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(page_size=12), "page_size a power of two"),
        (dict(head_dim=96), "power of two >= 16"),
        (dict(pages_dtype=jnp.bfloat16), "must match q dtype"),
        (dict(scales=True), "need int8 or int4 pages"),
        (dict(int4=True, head_dim=16), "head dim >= 32 for int4"),
        (dict(num_heads=6, num_kv_heads=4), "not a multiple"),
        (dict(pages_per_block=1, page_size=8), "power of two >= 16"),
        (dict(soft_cap=-1.0), "soft_cap must be positive"),
    ],
)
def test_gpu_kernel_rejects_unsupported_inputs(change, match):
    H, KVH = change.get("num_heads", 4), change.get("num_kv_heads", 2)
    D, ps = change.get("head_dim", 64), change.get("page_size", 16)
    q = jnp.zeros((8, H, D), jnp.float32)
    if change.get("int4"):
        pages = jnp.zeros((KVH, 5, ps, D // 2), jnp.uint8)
    else:
        pages = jnp.zeros((KVH, 5, ps, D), change.get("pages_dtype", jnp.float32))
    kw = dict(
        sm_scale=1.0, soft_cap=change.get("soft_cap"), pages_per_block=change.get("pages_per_block")
    )
    if change.get("scales") or change.get("int4"):
        kw.update(k_scale=jnp.ones((KVH, 5, ps)), v_scale=jnp.ones((KVH, 5, ps)))
    with pytest.raises(ValueError, match=match):
        gpu.ragged_paged_attention(
            q,
            pages,
            pages,
            jnp.ones(2, jnp.int32),
            jnp.ones((2, 3), jnp.int32),
            jnp.array([0, 1, 2], jnp.int32),
            jnp.int32(2),
            **kw,
        )


@pytest.mark.sweep
@pytest.mark.parametrize("cfg", kc.sweep_configs(), ids=lambda c: c.id)
def test_gpu_kernel_sweep(cfg):
    kc.check_against_reference_and_oracle(_runner(**TEST_OPTIONS), cfg)
