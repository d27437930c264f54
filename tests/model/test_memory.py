"""KV memory formula and planner: hand-computed numbers and round trips."""

from __future__ import annotations

import pytest

from jaxkv.config import ModelConfig
from jaxkv.model.memory import (
    bytes_per_token,
    kv_cache_breakdown,
    kv_cache_bytes,
    max_batch,
    max_context,
    pages_for_budget,
    param_count,
    weight_bytes,
)

# The worked example: 48 layers, 64 KV heads, head_dim 128, 4096 tokens, fp16.
EXAMPLE = dict(num_layers=48, num_kv_heads=64, head_dim=128)
EXAMPLE_BYTES = 6_442_450_944


def cfg(num_kv_heads=64, **kw) -> ModelConfig:
    base = dict(
        architecture="llama",
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=22016,
        num_layers=48,
        num_heads=64,
        num_kv_heads=num_kv_heads,
        head_dim=128,
    )
    base.update(kw)
    return ModelConfig(**base)


def test_worked_example():
    assert kv_cache_bytes(48, 64, 128, 4096, batch=1, dtype="float16") == EXAMPLE_BYTES
    assert EXAMPLE_BYTES == 6 * 2**30
    b = kv_cache_breakdown(48, 64, 128, 4096)
    assert b.data_bytes == EXAMPLE_BYTES and b.scale_bytes == 0
    assert b.bytes_per_token == 2 * 48 * 64 * 128 * 2 == 1_572_864
    assert "6,442,450,944" in b.table()


@pytest.mark.parametrize("dtype, factor", [("float32", 2), ("bfloat16", 1), ("float16", 1)])
def test_dtype_scales_bytes(dtype, factor):
    assert kv_cache_bytes(48, 64, 128, 4096, dtype=dtype) == factor * EXAMPLE_BYTES


@pytest.mark.parametrize("kv_heads", [64, 8, 1])  # MHA, GQA 8:1, MQA
def test_gqa_and_mqa_shrink_by_head_ratio(kv_heads):
    assert kv_cache_bytes(48, kv_heads, 128, 4096) * (64 // kv_heads) == EXAMPLE_BYTES
    assert bytes_per_token(cfg(kv_heads)) * 4096 * (64 // kv_heads) == EXAMPLE_BYTES


def test_linear_in_tokens_and_batch():
    one = kv_cache_bytes(2, 4, 16, 1)
    assert one == 2 * 2 * 4 * 16 * 2
    assert kv_cache_bytes(2, 4, 16, 100, batch=3) == 300 * one
    assert kv_cache_bytes(2, 4, 16, 0) == 0


def test_int8_includes_scales():
    b = kv_cache_breakdown(48, 64, 128, 4096, dtype="int8")
    data = EXAMPLE_BYTES // 2  # one byte per element
    scales = 2 * 48 * 64 * 4096 * 4  # fp32 per token and KV head, for K and V
    assert (b.data_bytes, b.scale_bytes) == (data, scales)
    assert kv_cache_bytes(48, 64, 128, 4096, dtype="int8") == data + scales == 3_321_888_768
    assert b.bytes_per_token * 4096 == b.total_bytes
    assert kv_cache_bytes(48, 64, 128, 4096, dtype="int8", scale_bytes_per_token_head=0) == data


def test_rejects_unknown_dtype_and_bad_sizes():
    with pytest.raises(ValueError, match="dtype"):
        kv_cache_bytes(1, 1, 1, 1, dtype="float8")
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_cache_bytes(1, 0, 1, 1)
    with pytest.raises(ValueError, match="context"):
        max_batch(cfg(), 0, 1 << 30)


@pytest.mark.parametrize("model", [cfg(8), (48, 8, 128), dict(EXAMPLE, num_kv_heads=8)])
@pytest.mark.parametrize("batch, context", [(1, 4096), (7, 1000), (32, 8192)])
@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_max_batch_and_context_round_trip(model, batch, context, dtype):
    w = 13_000_000_000
    need = kv_cache_bytes(48, 8, 128, context, batch=batch, dtype=dtype)
    assert max_batch(model, context, need + w, w, dtype) == batch
    assert max_batch(model, context, need + w - 1, w, dtype) == batch - 1
    assert max_context(model, batch, need + w, w, dtype) == context
    assert max_context(model, batch, need + w - 1, w, dtype) == context - 1
    assert max_batch(model, context, w // 2, w, dtype) == 0  # weights alone do not fit


def test_paged_planning_counts_whole_pages_and_trash_page():
    model, ps = (2, 2, 8), 16
    page = kv_cache_bytes(2, 2, 8, ps)
    assert pages_for_budget(10 * page, 2, 2, 8, ps) == 10
    assert pages_for_budget(10 * page - 1, 2, 2, 8, ps) == 9
    # 10 pages: 9 usable. A 17-token sequence takes 2 pages -> 4 sequences.
    assert max_batch(model, 17, 10 * page, page_size=ps) == 4
    assert max_batch(model, 16, 10 * page, page_size=ps) == 9
    assert max_context(model, 4, 10 * page, page_size=ps) == 2 * ps
    assert max_context(model, 9, 10 * page, page_size=ps) == ps


def test_param_count_llama2_7b():
    llama2_7b = ModelConfig(
        architecture="llama",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
    )
    assert param_count(llama2_7b) == 6_738_415_616  # the published count
    assert weight_bytes(llama2_7b, "bfloat16") == 2 * 6_738_415_616


def test_param_count_biases_and_tied_head():
    small = dict(
        architecture="qwen2",
        vocab_size=10,
        hidden_size=4,
        intermediate_size=6,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=2,
    )
    plain = param_count(ModelConfig(**small))
    # embed 40 + head 40 + q 16 + k 8 + v 8 + o 16 + mlp 72 + norms 8 + final 4
    assert plain == 212
    assert param_count(ModelConfig(**small, attention_bias=True)) == plain + 4 + 2 + 2
    assert param_count(ModelConfig(**small, attention_out_bias=True)) == plain + 4
    assert param_count(ModelConfig(**small, tie_word_embeddings=True)) == plain - 40


SMALL = dict(
    architecture="llama",
    vocab_size=100,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)
# One page of 16 tokens, float32: 2 (K, V) x 4 layers x 2 KV heads x 16 dims x 16 tokens x 4 B.
SMALL_PAGE = 2 * 4 * 2 * 16 * 16 * 4


@pytest.fixture
def host(monkeypatch):
    """A CPU-like host: devices report no memory; available RAM as set."""
    from jaxkv.model import pool_sizing as pool_plan

    monkeypatch.setattr(pool_plan, "_free_device_memory", lambda: None)
    avail = {"bytes": 16 << 30}
    monkeypatch.setattr(pool_plan, "host_available_memory", lambda: avail["bytes"])
    return avail


def test_cpu_pool_holds_what_the_run_can_use(host):
    from jaxkv.config import EngineConfig
    from jaxkv.model.pool_sizing import HOST_POOL_MAX, plan_num_pages

    m = ModelConfig(**SMALL)
    # 2 sequences of 1000 tokens: 63 pages each, + the trash page.
    c = EngineConfig(max_num_seqs=2, max_model_len=1000)
    assert plan_num_pages(c, m, "float32") == 2 * 63 + 1
    # max_model_len unset: the model's 4096 positions, 256 pages a sequence.
    assert plan_num_pages(EngineConfig(max_num_seqs=3), m, "float32") == 3 * 256 + 1
    # bfloat16 pages are half the bytes, not fewer pages: the need is in tokens.
    assert plan_num_pages(c, m, "bfloat16") == 2 * 63 + 1
    # Capped by the available memory's fraction, and by HOST_POOL_MAX.
    host["bytes"] = 100 * SMALL_PAGE
    assert plan_num_pages(EngineConfig(max_num_seqs=64), m, "float32") == 80  # 0.8 x 100
    host["bytes"] = 1 << 40
    big = ModelConfig(**dict(SMALL, num_layers=400, max_position_embeddings=1 << 16))
    assert plan_num_pages(EngineConfig(), big, "float32") == HOST_POOL_MAX // (100 * SMALL_PAGE)
    # Asked for: the budget decides, with units.
    assert (
        plan_num_pages(EngineConfig(kv_cache_memory="64KiB"), m, "float32") == 65536 // SMALL_PAGE
    )
    assert plan_num_pages(EngineConfig(num_pages=7), m, "float32") == 7


def test_kv_cache_memory_takes_units():
    from jaxkv.config import EngineConfig

    assert EngineConfig(kv_cache_memory="64MB").kv_cache_memory == 64_000_000
    assert EngineConfig(kv_cache_memory="1.5 GiB").kv_cache_memory == 3 << 29
    assert EngineConfig(kv_cache_memory=1000).kv_cache_memory == 1000
    with pytest.raises(ValueError, match="kv_cache_memory: not a size"):
        EngineConfig(kv_cache_memory="lots")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory="0MB")


@pytest.mark.parametrize(
    "extra,seqs,model_len",
    [
        ([], 1, len("héllo".encode()) + 256 + 10),  # the pool for this one request
        (["--n", "3"], 3, len("héllo".encode()) + 256 + 10),
        (["--max-model-len", "900"], 1, 900),
        (["--kv-cache-memory", "64MB"], 64, None),  # a budget given: the engine's defaults
    ],
)
def test_generate_sizes_the_default_pool_for_its_request(monkeypatch, extra, seqs, model_len):
    from jaxkv.config import EngineConfig
    from jaxkv.entrypoints import cli

    seen = {}

    def make_engine(a):
        seen.update(cli.values(a, EngineConfig, prefix=cli.ENGINE))
        raise SystemExit(0)

    monkeypatch.setattr(cli, "_make_engine", make_engine)
    a = cli.build_parser().parse_args(["generate", "héllo", "--max-tokens", "10", *extra])
    with pytest.raises(SystemExit):
        a.func(a)
    assert (seen["max_num_seqs"], seen["max_model_len"]) == (seqs, model_len)
