"""The Pallas Mosaic GPU (Hopper) kernel run on CPU in jax's Mosaic GPU
interpret mode (TMA copies, barriers and wgmma simulated) against the
reference and the naive float64 oracle, over the kernel test grid in the
dtypes the kernel takes and in every KV page format; the grid's
configurations it refuses must raise ValueError; and the kernel lowers for
CUDA without a GPU, in every format."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import mosaic_gpu
from tests.helpers import kernel_cases as kc

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _fresh_interpret_state():
    # The interpret mode keeps process-wide simulated memory; a kernel that
    # raised mid-run leaves it dirty for the next test.
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    gpu_callbacks.reset_gpu_interpret_mode_state()
    yield


def _runner(**options):
    def run(args, **kw):
        return mosaic_gpu.ragged_paged_attention(**args, **kw, interpret=True, **options)

    return run


def _refusal(cfg):
    """The ValueError message (a regex) for a config the kernel refuses, or None."""
    return "bfloat16 or float16" if cfg.dtype == "float32" else None


# The default grid as the kernel takes it: its bfloat16 configs (int8
# included), and the bfloat16 twin of each float32 one without int8 (so
# every page size, GQA ratio, head dim, window and cap still appear).
SUPPORTED = [c for c in kc.DEFAULT_CONFIGS if _refusal(c) is None] + [
    c._replace(dtype="bfloat16") for c in kc.DEFAULT_CONFIGS if c.dtype == "float32" and not c.int8
]
REFUSED = [c for c in kc.DEFAULT_CONFIGS if _refusal(c) is not None]
# The int4 and fp8 configs, float32 ones as their bfloat16 twins.
FORMATS = [c._replace(dtype="bfloat16") for c in kc.FORMAT_CONFIGS]


def test_grid_covers_the_default_grid():
    assert len(SUPPORTED) + sum(c.int8 for c in REFUSED) >= len(kc.DEFAULT_CONFIGS)
    assert {c.fmt for c in SUPPORTED + FORMATS} == {"float", *kc.KV_FORMATS}
    for attr in ("head_dim", "page_size", "sliding_window", "soft_cap"):
        assert {getattr(c, attr) for c in SUPPORTED} >= {
            getattr(c, attr) for c in kc.DEFAULT_CONFIGS if not c.int8
        }
    assert {c.num_heads // c.num_kv_heads for c in SUPPORTED} == {1, 3, 8}


@pytest.mark.parametrize("cfg", SUPPORTED, ids=lambda c: c.id)
def test_mosaic_gpu_kernel_matches_reference_and_oracle(cfg):
    kc.check_against_reference_and_oracle(_runner(), cfg)


@pytest.mark.parametrize("cfg", FORMATS, ids=lambda c: c.id)
def test_mosaic_gpu_kernel_reads_int4_and_fp8_pages(cfg):
    kc.check_against_reference_and_oracle(_runner(), cfg)


@pytest.mark.parametrize("cfg", REFUSED, ids=lambda c: c.id)
def test_mosaic_gpu_kernel_refuses_the_rest_of_the_grid(cfg):
    (_, case, kw), _ = kc.config_batches(cfg)
    args = {k: jnp.asarray(v) for k, v in case.items()}
    with pytest.raises(ValueError, match=_refusal(cfg)):
        _runner()(args, **kw)


def test_mosaic_gpu_kernel_128_key_blocks():
    # 4 pages of 32 per pipeline step; windowed rows start mid-block.
    kc.check_against_reference_and_oracle(
        _runner(block_kv=128), kc.Config("bfloat16", 64, 32, 6, 2, sliding_window=40)
    )


def test_mosaic_gpu_kernel_all_decode_grid():
    # all_decode=True: one work block per sequence instead of the ragged bound.
    cfg = kc.Config("bfloat16", 128, 16, 8, 1, sliding_window=24)
    _, (_, case, kw) = kc.config_batches(cfg)  # the decode batch
    args = {k: jnp.asarray(v) for k, v in case.items()}
    got = np.asarray(_runner(all_decode=True)(args, **kw).astype(jnp.float32))
    want = kc.oracle(case, **kw)
    np.testing.assert_allclose(got, want, atol=3e-2, rtol=3e-2)
    np.testing.assert_array_equal(got, np.asarray(_runner()(args, **kw).astype(jnp.float32)))


def test_mosaic_gpu_kernel_float16():
    case = kc.batch(
        3, page_size=16, kind="mixed", num_heads=4, num_kv_heads=2, head_dim=64, dtype=np.float16
    )
    kw = dict(sm_scale=0.125, soft_cap=10.0)
    args = {k: jnp.asarray(v) for k, v in case.items()}
    got = np.asarray(_runner()(args, **kw).astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, kc.oracle(case, **kw), atol=1e-2, rtol=1e-2)


def test_mosaic_gpu_kernel_no_sequences_gives_zeros():
    cfg = SUPPORTED[0]  # same shapes and options: reuses that compile
    (_, case, kw), _ = kc.config_batches(cfg)
    args = {k: jnp.asarray(v) for k, v in case.items()}
    args["num_seqs"] = jnp.int32(0)
    np.testing.assert_array_equal(np.asarray(_runner()(args, **kw).astype(jnp.float32)), 0.0)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(dtype=jnp.float32), "bfloat16 or float16"),
        (dict(page_size=12), "page_size a power of two"),
        (dict(page_size=4), "page_size a power of two"),
        (dict(page_size=128), "page_size a power of two"),
        (dict(head_dim=96), "head dim in"),
        (dict(head_dim=256), "head dim in"),
        (dict(block_kv=32), "block_kv in"),
        (dict(num_heads=128, num_kv_heads=1), "at most 64 query heads"),
        (dict(pages_dtype=jnp.float16), "must match q dtype"),
        (dict(scales=True), "need int8 or int4 pages"),
        (dict(num_heads=6, num_kv_heads=4), "not a multiple"),
        (dict(soft_cap=-1.0), "soft_cap must be positive"),
        (dict(interpret="yes"), "interpret must be"),
    ],
)
def test_mosaic_gpu_kernel_rejects_unsupported_inputs(change, match):
    H, KVH = change.get("num_heads", 4), change.get("num_kv_heads", 2)
    D, ps = change.get("head_dim", 64), change.get("page_size", 16)
    dtype = change.get("dtype", jnp.bfloat16)
    q = jnp.zeros((8, H, D), dtype)
    pages = jnp.zeros((KVH, 5, ps, D), change.get("pages_dtype", dtype))
    kw = dict(
        sm_scale=1.0, soft_cap=change.get("soft_cap"), interpret=change.get("interpret", True)
    )
    if "block_kv" in change:
        kw["block_kv"] = change["block_kv"]
    if change.get("scales"):
        kw.update(k_scale=jnp.ones((KVH, 5, ps)), v_scale=jnp.ones((KVH, 5, ps)))
    with pytest.raises(ValueError, match=match):
        mosaic_gpu.ragged_paged_attention(
            q,
            pages,
            pages,
            jnp.ones(2, jnp.int32),
            jnp.ones((2, 3), jnp.int32),
            jnp.array([0, 1, 2], jnp.int32),
            jnp.int32(2),
            **kw,
        )


# (q dtype, head_dim, page_size, H, KVH, kwargs): what a Hopper serving
# config looks like, plus window / cap, 128-key blocks, the decode grid and
# learned sinks (sinks=True: a float32 [H] argument), and the KV formats
# (kv=: fp8 dtypes; int8 and int4 with their scales).
LOWERING_CONFIGS = [
    ("bfloat16", 128, 16, 32, 8, {}),
    ("bfloat16", 64, 8, 8, 1, {}),
    ("float16", 64, 8, 6, 2, dict(sliding_window=64, soft_cap=30.0)),
    ("bfloat16", 128, 64, 4, 4, dict(block_kv=128)),
    ("bfloat16", 64, 16, 4, 4, dict(all_decode=True)),
    ("bfloat16", 64, 16, 16, 2, dict(sinks=True, sliding_window=128)),
    ("bfloat16", 128, 16, 32, 8, dict(kv="float8_e4m3fn")),
    ("float16", 64, 8, 8, 1, dict(kv="float8_e5m2", soft_cap=30.0, block_kv=128)),
    ("bfloat16", 128, 16, 32, 8, dict(kv="int8", sliding_window=128)),
    ("bfloat16", 128, 16, 32, 8, dict(kv="int4")),
    ("float16", 64, 8, 8, 1, dict(kv="int4", block_kv=128, sinks=True)),
]


@pytest.mark.parametrize(
    "config",
    LOWERING_CONFIGS,
    ids=lambda c: "-".join(
        [c[0], f"d{c[1]}", f"p{c[2]}", f"h{c[3]}kv{c[4]}"] + [str(v) for v in c[5].values()]
    ),
)
def test_mosaic_gpu_kernel_lowers_for_cuda(config):
    # Pallas -> Mosaic GPU -> the kernel module (TMA, mbarriers, wgmma) inside
    # one XLA custom call; the PTX / SASS compile happens only when XLA
    # compiles on a GPU. The layout, swizzle and TMA checks of Mosaic GPU run
    # here (a mismatched wgmma swizzle fails at this step).
    dtype, d, ps, h, kvh, kw = config
    kw = dict(kw)
    with_sinks = kw.pop("sinks", False)
    kv = kw.pop("kv", dtype)
    T, S, W, P = 64, 8, 32, 300
    sds = jax.ShapeDtypeStruct
    pages = (
        sds((kvh, P, ps, d // 2), jnp.uint8)
        if kv == "int4"
        else sds((kvh, P, ps, d), jnp.dtype(kv))
    )
    scale_dtype = {"int8": jnp.float32, "int4": jnp.bfloat16}.get(kv)
    scales = [sds((kvh, P, ps), scale_dtype)] * 2 if scale_dtype else []
    specs = [
        sds((T, h, d), dtype),
        pages,
        pages,
        sds((S,), jnp.int32),
        sds((S, W), jnp.int32),
        sds((S + 1,), jnp.int32),
        sds((), jnp.int32),
        *scales,
    ] + ([sds((h,), jnp.float32)] if with_sinks else [])

    def f(*args):
        extra = dict(sinks=args[-1]) if with_sinks else {}
        if scales:
            extra.update(k_scale=args[7], v_scale=args[8])
        return mosaic_gpu.ragged_paged_attention(*args[:7], sm_scale=d**-0.5, **kw, **extra)

    # As for the Triton kernel: newer jax reads the target GPU from the mesh.
    device = jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu"
    )
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    ):
        text = jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    calls = [l for l in text.splitlines() if re.search(r"custom_call @mosaic_gpu", l)]
    assert len(calls) == 1
    assert "wgmma" in calls[0]
