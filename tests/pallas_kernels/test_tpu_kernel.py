"""The Mosaic TPU kernel run on CPU in TPU interpret mode (simulated VMEM,
SMEM, DMAs and semaphores; race detector on) against the reference and the
naive float64 oracle."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention import tpu
from tests.helpers import kernel_cases as kc

# The grid runs in plain interpret mode (DMAs run at their wait, so a missing
# wait leaves a buffer unfilled: NaN, and the comparison fails). Race detection
# costs time quadratic in the accesses, so it runs on two configs: "eager"
# executes each DMA when it starts, so reading a buffer before its wait is a
# race the detector reports; "on_wait" with the detector checks the same
# happens-before order as the DMAs actually complete.
PLAIN = pltpu.InterpretParams()
EAGER_RACES = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
ON_WAIT_RACES = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait")
# 4 pages per KV block: several blocks per sequence, so double buffering and
# the prefetch of the next sequence's first block are exercised.
TEST_BLOCKS = dict(pages_per_block=4)


def _races_found():
    # TPU interpret mode records races in this module global (jax 0.10 API:
    # "races.races_found will be set to True").
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    return interpret_pallas_call.races.races_found


def _runner(interpret=PLAIN, **options):
    def run(args, **kw):
        out = tpu.ragged_paged_attention(**args, **kw, interpret=interpret, **options)
        out.block_until_ready()
        if interpret.detect_races:
            assert not _races_found(), "TPU interpret mode detected a data race"
        return out

    return run


@pytest.mark.parametrize("cfg", kc.DEFAULT_CONFIGS, ids=lambda c: c.id)
def test_tpu_kernel_matches_reference_and_oracle(cfg):
    kc.check_against_reference_and_oracle(_runner(**TEST_BLOCKS), cfg)


@pytest.mark.parametrize("cfg", kc.FORMAT_CONFIGS, ids=lambda c: c.id)
def test_tpu_kernel_reads_int4_and_fp8_pages(cfg):
    kc.check_against_reference_and_oracle(_runner(**TEST_BLOCKS), cfg)


@pytest.mark.parametrize("interpret", [EAGER_RACES, ON_WAIT_RACES], ids=["eager", "on_wait"])
def test_tpu_kernel_has_no_dma_races(interpret):
    # int4: the scale DMAs ride along, and its packed [.., D // 2] pages move by
    # the same page DMAs as int8 / fp8 ones; one KV head keeps the detector's
    # cost down.
    kc.check_against_reference_and_oracle(
        _runner(interpret, **TEST_BLOCKS), kc.Config("bfloat16", 128, 16, 8, 1, kv="int4")
    )


def test_tpu_kernel_default_blocks():
    kc.check_against_reference_and_oracle(_runner(), kc.Config("bfloat16", 128, 32, 6, 2))


def test_tpu_kernel_no_sequences_gives_zeros():
    cfg = kc.DEFAULT_CONFIGS[0]  # same shapes and options: reuses that compile
    (_, case, kw), _ = kc.config_batches(cfg)
    args = {k: jnp.asarray(v) for k, v in case.items()}
    args["num_seqs"] = jnp.int32(0)
    out = _runner(**TEST_BLOCKS)(args, **kw)
    np.testing.assert_array_equal(np.asarray(out), 0.0)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(page_size=12), "page_size a multiple of 8"),
        (dict(head_dim=48), "head dim a multiple of 64"),
        (dict(pages_dtype=jnp.bfloat16), "must match q dtype"),
        (dict(scales=True), "need int8 or int4 pages"),
        (dict(pages_dtype=jnp.float8_e4m3fn, scales=True), "need int8 or int4 pages"),
        (dict(pages_dtype=jnp.uint8), "head dim mismatch"),  # int4 holds D // 2 bytes a token
        (dict(pages_dtype=jnp.uint8, page_dim=32), "int4 pages need k_scale"),
        (dict(num_heads=6, num_kv_heads=4), "not a multiple"),
        (dict(block_q=2), "multiple of 16"),
        (dict(sliding_window=0), "sliding_window must be positive"),
    ],
)
def test_tpu_kernel_rejects_unsupported_inputs(change, match):
    H, KVH = change.get("num_heads", 4), change.get("num_kv_heads", 2)
    D, ps = change.get("head_dim", 64), change.get("page_size", 8)
    q = jnp.zeros((8, H, D), jnp.float32)
    pages = jnp.zeros(
        (KVH, 5, ps, change.get("page_dim", D)), change.get("pages_dtype", jnp.float32)
    )
    kw = dict(
        sm_scale=1.0, sliding_window=change.get("sliding_window"), block_q=change.get("block_q", 16)
    )
    if change.get("scales"):
        kw.update(k_scale=jnp.ones((KVH, 5, ps)), v_scale=jnp.ones((KVH, 5, ps)))
    with pytest.raises(ValueError, match=match):
        tpu.ragged_paged_attention(
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
def test_tpu_kernel_sweep(cfg):
    kc.check_against_reference_and_oracle(_runner(pages_per_block=4), cfg)
