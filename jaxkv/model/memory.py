"""KV cache memory: the size formula and the weights' bytes (the pool plan built
on them is `jaxkv.model.pool_sizing`).

The KV cache of one layer holds a K and a V vector of D elements per KV head
per token, so for L layers, KVH KV heads, a context of `tokens` and `batch`
sequences:

    bytes = 2 x L x KVH x D x tokens x batch x bytes_per_element
            (+ 2 x L x KVH x tokens x batch x s   for int8 and int4: one
               scale per token and KV head, for K and for V; s = 4
               (float32) for int8, 2 (bfloat16) for int4)

int4 holds half a byte per element (two values a byte); fp8 one byte, and
its scales are one float32 per KV head and layer, 2 x L x KVH x 4 bytes for
the whole pool (the `fixed_bytes` term), not per token.

e.g. 48 layers, 64 KV heads, D 128, 4096 tokens, batch 1, float16:
2 x 48 x 64 x 128 x 4096 x 2 = 6,442,450,944 bytes (6 GiB). Grouped-query
attention divides this by H / KVH, which is why KVH, not H, appears.
The int8 scale layout matches `jaxkv.model.kv_cache` (k_scale, v_scale:
L x [KVH, P, page_size] float32). Functions that take a model accept a `jaxkv.config.ModelConfig` (or any
object with `num_layers`, `num_kv_heads`, `head_dim`), a mapping with those
keys, or a plain `(num_layers, num_kv_heads, head_dim)` tuple.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# Element sizes (bits) of the KV dtypes `CacheConfig.kv_dtype` accepts.
DTYPE_BITS = {
    "float32": 32,
    "bfloat16": 16,
    "float16": 16,
    "int8": 8,
    "int4": 4,
    "fp8": 8,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
}
DTYPE_BYTES = {k: v // 8 for k, v in DTYPE_BITS.items() if v >= 8}  # weights' dtypes too
# The scale per (token, KV head), for K and for V: float32 for int8,
# bfloat16 for int4 (34 bytes a token and head at D 64, half of int8's 68).
INT8_SCALE_BYTES = 4
INT4_SCALE_BYTES = 2
FP8_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def dtype_bits(dtype: str) -> int:
    """Bits per KV element of `dtype` (a `CacheConfig.kv_dtype` name)."""
    try:
        return DTYPE_BITS[dtype]
    except KeyError:
        raise ValueError(
            f"dtype: unsupported KV dtype {dtype!r}; supported: {sorted(DTYPE_BITS)}"
        ) from None


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of `dtype` (whole bytes: not int4)."""
    if dtype not in DTYPE_BYTES:
        dtype_bits(dtype)
        raise ValueError(f"dtype: {dtype!r} is not a whole number of bytes per element")
    return DTYPE_BYTES[dtype]


def _default_scale_bytes(dtype: str, scale_bytes_per_token_head: int | None) -> int:
    return (
        scale_bytes_per_token_head
        if scale_bytes_per_token_head is not None
        else (INT8_SCALE_BYTES if dtype == "int8" else INT4_SCALE_BYTES if dtype == "int4" else 0)
    )


@dataclasses.dataclass(frozen=True)
class KVBreakdown:
    """Every term of the KV size formula, for reports and planners."""

    num_layers: int  # L
    num_kv_heads: int  # KVH
    head_dim: int  # D
    tokens: int  # context per sequence
    batch: int  # B
    dtype: str
    bits_per_element: int
    scale_bytes_per_token_head: int  # per K or V, 0 unless int8 / int4

    @property
    def bytes_per_element(self) -> float:
        return self.bits_per_element / 8

    @property
    def elements(self) -> int:
        """K and V elements: 2 x L x KVH x D x tokens x B."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.tokens * self.batch

    @property
    def data_bytes(self) -> int:
        return self.elements * self.bits_per_element // 8

    @property
    def scale_bytes(self) -> int:
        """2 x L x KVH x tokens x B x scale bytes (int8 and int4)."""
        return (
            2
            * self.num_layers
            * self.num_kv_heads
            * self.tokens
            * self.batch
            * self.scale_bytes_per_token_head
        )

    @property
    def fixed_bytes(self) -> int:
        """fp8: one float32 scale per KV head and layer, for K and for V."""
        return 2 * self.num_layers * self.num_kv_heads * 4 if self.dtype in FP8_DTYPES else 0

    @property
    def total_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes + self.fixed_bytes

    @property
    def bytes_per_token(self) -> int:
        """Cost of one more token of one sequence."""
        return (
            2
            * self.num_layers
            * self.num_kv_heads
            * (self.head_dim * self.bits_per_element // 8 + self.scale_bytes_per_token_head)
        )

    def table(self) -> str:
        """The terms as a markdown table."""
        rows = [
            ("layers (L)", f"{self.num_layers}"),
            ("KV heads (KVH)", f"{self.num_kv_heads}"),
            ("head dim (D)", f"{self.head_dim}"),
            ("tokens", f"{self.tokens:,}"),
            ("batch (B)", f"{self.batch}"),
            ("dtype", f"{self.dtype} ({self.bytes_per_element:g} B/element)"),
            ("K+V elements 2·L·KVH·D·tokens·B", f"{self.elements:,}"),
            ("data bytes", f"{self.data_bytes:,}"),
            ("scale bytes 2·L·KVH·tokens·B·s", f"{self.scale_bytes:,}"),
            ("fixed scale bytes 2·L·KVH·4 (fp8)", f"{self.fixed_bytes:,}"),
            ("bytes per token", f"{self.bytes_per_token:,}"),
            ("total bytes", f"{self.total_bytes:,} ({self.total_bytes / 2**30:.3f} GiB)"),
        ]
        return "\n".join(["| term | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def kv_cache_breakdown(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tokens: int,
    batch: int = 1,
    dtype: str = "float16",
    scale_bytes_per_token_head: int | None = None,
) -> KVBreakdown:
    """The KV size formula's terms. `scale_bytes_per_token_head` defaults to
    4 (a float32 scale) for int8, 2 (bfloat16) for int4 and 0 otherwise."""
    for name, v in (
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        if v <= 0:
            raise ValueError(f"{name}: must be positive, got {v}")
    if tokens < 0 or batch < 0:
        raise ValueError(f"tokens and batch must be non-negative, got {tokens}, {batch}")
    return KVBreakdown(
        num_layers,
        num_kv_heads,
        head_dim,
        tokens,
        batch,
        dtype,
        dtype_bits(dtype),
        _default_scale_bytes(dtype, scale_bytes_per_token_head),
    )


def kv_cache_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    tokens: int,
    batch: int = 1,
    dtype: str = "float16",
    scale_bytes_per_token_head: int | None = None,
) -> int:
    """Bytes of K and V (and their scales) for `batch` sequences of `tokens`:
    2 x L x KVH x D x tokens x batch x bytes_per_element (+ scales)."""
    return kv_cache_breakdown(
        num_layers, num_kv_heads, head_dim, tokens, batch, dtype, scale_bytes_per_token_head
    ).total_bytes


def _geometry(model: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a config, mapping or tuple."""
    keys = ("num_layers", "num_kv_heads", "head_dim")
    if isinstance(model, Mapping):
        return tuple(int(model[k]) for k in keys)  # type: ignore[return-value]
    if isinstance(model, (tuple, list)):
        if len(model) != 3:
            raise ValueError(f"model: expected (num_layers, num_kv_heads, head_dim), got {model!r}")
        return tuple(int(x) for x in model)  # type: ignore[return-value]
    return tuple(int(getattr(model, k)) for k in keys)  # type: ignore[return-value]


def bytes_per_token(model: Any, dtype: str = "float16") -> int:
    """KV bytes one token of one sequence costs (all layers, K and V)."""
    return kv_cache_breakdown(*_geometry(model), tokens=1, dtype=dtype).bytes_per_token


def _kv_tokens(model: Any, budget_bytes: int, weight_bytes: int, dtype: str) -> int:
    """Tokens (of one sequence) whose KV fits beside the weights."""
    return max(budget_bytes - weight_bytes, 0) // bytes_per_token(model, dtype)


def _usable_pages(
    model: Any, budget_bytes: int, weight_bytes: int, dtype: str, page_size: int
) -> int:
    """Whole pages that fit beside the weights, less the trash page."""
    per_page = bytes_per_token(model, dtype) * page_size
    return max(max(budget_bytes - weight_bytes, 0) // per_page - 1, 0)


def max_batch(
    model: Any,
    context: int,
    budget_bytes: int,
    weight_bytes: int = 0,
    dtype: str = "float16",
    page_size: int | None = None,
) -> int:
    """Most sequences of `context` tokens whose KV fits in `budget_bytes`
    after `weight_bytes` of weights (and whatever else the caller subtracts).

    With `page_size`, counts as jaxkv's paged cache allocates: each sequence
    takes whole pages and one page is the reserved trash page."""
    if context <= 0:
        raise ValueError(f"context: must be positive, got {context}")
    if page_size is None:
        return _kv_tokens(model, budget_bytes, weight_bytes, dtype) // context
    return _usable_pages(model, budget_bytes, weight_bytes, dtype, page_size) // -(
        -context // page_size
    )


def max_context(
    model: Any,
    batch: int,
    budget_bytes: int,
    weight_bytes: int = 0,
    dtype: str = "float16",
    page_size: int | None = None,
) -> int:
    """Longest context (tokens per sequence) that `batch` sequences can all
    hold in `budget_bytes` after `weight_bytes`. With `page_size`, a multiple
    of it, after the reserved trash page. Not capped by the model's maximum
    positions: compare with `max_position_embeddings` yourself."""
    if batch <= 0:
        raise ValueError(f"batch: must be positive, got {batch}")
    if page_size is None:
        return _kv_tokens(model, budget_bytes, weight_bytes, dtype) // batch
    return _usable_pages(model, budget_bytes, weight_bytes, dtype, page_size) // batch * page_size


def pages_for_budget(
    budget_bytes: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: str = "float16",
) -> int:
    """Pages of `page_size` tokens that fit in `budget_bytes`: the value for
    `CacheConfig.num_pages`, trash page 0 included (so one fewer is usable)."""
    if page_size <= 0:
        raise ValueError(f"page_size: must be positive, got {page_size}")
    page = kv_cache_bytes(num_layers, num_kv_heads, head_dim, page_size, dtype=dtype)
    return max(budget_bytes, 0) // page


def mlp_params(cfg: Any) -> dict[str, int]:
    """The MLPs' parameters over all layers, by term (`jaxkv.model.params`):
    "dense" 3·E·F per dense layer; per sparse layer (`layer_sparse`)
    "experts" X·3·E·Fm (gate, up, down of each of X experts), "shared"
    3·E·Fs (a shared expert, Fs > 0) and "router" E·X (+ E, the shared
    expert's gate). With `moe_bias` (gpt-oss) each expert adds its
    2Fm + E biases to "experts" and the router its X."""
    E, L = cfg.hidden_size, cfg.num_layers
    X, Fm, Fs = (
        getattr(cfg, k, 0)
        for k in ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")
    )
    sparse = sum(1 for i in range(L) if cfg.layer_sparse(i)) if X else 0
    bias = bool(getattr(cfg, "moe_bias", False))
    return {
        "dense": (L - sparse) * 3 * E * cfg.intermediate_size,
        "experts": sparse * X * (3 * E * Fm + bias * (2 * Fm + E)),
        "shared": sparse * 3 * E * Fs,
        "router": sparse * (E * X + (E if Fs else 0) + bias * X),
    }


def param_count(cfg: Any) -> int:
    """Parameters of a `ModelConfig`'s decoder: embeddings, per layer
    q/k/v/o projections (+ biases), two RMSNorms (four with Gemma's post
    norms; q/k norms, sinks), the MLPs (`mlp_params`: dense, or experts,
    router and shared expert), the final norm, and the LM head unless tied."""
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = E * H * D + 2 * E * K * D + H * D * E
    if cfg.attention_bias:
        attn += H * D + 2 * K * D
    if getattr(cfg, "attention_out_bias", False):
        attn += E
    layer = attn + 2 * E + _small_per_layer(cfg)
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * E
    return cfg.vocab_size * E + cfg.num_layers * layer + sum(mlp_params(cfg).values()) + E + head


def active_param_count(cfg: Any) -> int:
    """Parameters one token runs through: all of `param_count` but the
    experts, of which k of X per sparse layer (Qwen3-30B-A3B: 3.3e9 of
    30.5e9). Embeddings and LM head count, as the published figures do."""
    X = getattr(cfg, "num_experts", 0)
    experts = mlp_params(cfg)["experts"]
    return param_count(cfg) - experts + (experts // X * cfg.num_experts_per_tok if X else 0)


def _small_per_layer(cfg: Any) -> int:
    """A layer's q/k norms, post norms and sinks (the families' extras)."""
    n = 2 * cfg.head_dim if getattr(cfg, "qk_norm", False) else 0
    n += 2 * cfg.hidden_size if getattr(cfg, "post_norms", False) else 0
    return n + (cfg.num_heads if getattr(cfg, "attention_sinks", False) else 0)


def weight_bytes(cfg: Any, dtype: str = "bfloat16") -> int:
    """Bytes of the weights stored in `dtype` ("float32", "bfloat16", ...)."""
    return param_count(cfg) * dtype_bytes(dtype)


def per_device_bytes(
    cfg: Any,
    tensor_parallel_size: int = 1,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    num_pages: int = 0,
    page_size: int = 16,
) -> dict[str, int]:
    """What one device holds when a `ModelConfig`'s model is split
    `tensor_parallel_size` ways (`jaxkv.sharding`'s table): {"params",
    "experts", "kv", "total"} bytes ("experts" is part of "params").
    Column- and row-parallel matrices divide by the shard count, the
    experts too (each expert's Fm columns, or X/t whole experts with expert
    parallelism: the same bytes), a shared expert as a dense MLP; norms,
    routers, the shared expert's gate, the rotary frequencies (float32) and
    the output bias stay whole; embed divides when E splits evenly,
    lm_head when V does; KV heads replicated to one per shard when there
    are fewer than shards (as stored) count in full. `num_pages` pages of
    `page_size` tokens of `kv_dtype` (default: dtype) for the KV pool."""
    from jaxkv.sharding import check_expert_split, check_tensor_parallel

    t = tensor_parallel_size
    K = check_tensor_parallel(cfg, t)  # KV heads as stored
    ep = bool(getattr(cfg, "num_experts", 0)) and cfg.moe_intermediate_size % t != 0
    if getattr(cfg, "num_experts", 0) and t > 1:  # expert parallel where Fm does not split
        check_expert_split(cfg, t, expert_parallel=ep)
    E, H, D, V = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.vocab_size
    split = (E * (H + 2 * K) * D + H * D * E) // t  # per layer
    if cfg.attention_bias:
        split += (H + 2 * K) * D // t
    whole = 2 * E + (E if cfg.attention_out_bias else 0)
    whole += (2 * D if getattr(cfg, "qk_norm", False) else 0) + (
        2 * E if getattr(cfg, "post_norms", False) else 0
    )
    b = dtype_bytes(dtype)
    mlp = mlp_params(cfg)
    # Tensor parallel keeps each expert's down bias [E] whole (moe_bias).
    whole_bias = (
        0
        if ep or not getattr(cfg, "moe_bias", False)
        else (sum(map(cfg.layer_sparse, range(cfg.num_layers))) * cfg.num_experts * E)
    )
    experts = ((mlp["experts"] - whole_bias) // t + whole_bias) * b
    params = (
        cfg.num_layers * (split + whole) + (mlp["dense"] + mlp["shared"]) // t + mlp["router"]
    ) * b
    params += experts + E * b + (D // 2) * 4
    if getattr(cfg, "attention_sinks", False):  # float32, split with the query heads
        params += cfg.num_layers * (H // t) * 4
    if getattr(cfg, "rope_local_theta", None) is not None:  # the sliding layers' frequencies
        params += (D // 2) * 4
    params += V * E * b // (t if E % t == 0 else 1)
    if not cfg.tie_word_embeddings:
        params += E * V * b // (t if V % t == 0 else 1)
    kv = kv_cache_bytes(cfg.num_layers, K // t, D, page_size, num_pages, kv_dtype or dtype)
    return {"params": params, "experts": experts, "kv": kv, "total": params + kv}
