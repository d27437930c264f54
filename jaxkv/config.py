"""Frozen configuration dataclasses.

ModelConfig is built by exactly one function per source: `from_hf_config` for a
Hugging Face ``config.json`` dict and `from_gguf_metadata` for GGUF key/values.
Both validate with `ModelConfig.validate`, which names the offending field.

Shape legend used throughout jaxkv: B batch, T tokens, S sequences, L layers,
H query heads, K/KVH kv heads, D head dim, P pages, V vocab, E embed,
F MLP hidden (intermediate).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

# Hugging Face `architectures` / `model_type` values we can run: all are the
# same decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP); they differ only in
# biases, windows and defaults, which the config fields carry.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int  # V
    hidden_size: int  # E
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # KVH
    head_dim: int  # D
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases
    attention_out_bias: bool = False  # output projection bias (Llama's attention_bias)
    max_position_embeddings: int = 2048
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        if self.architecture not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"architecture: unknown architecture {self.architecture!r}; "
                f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta: must be positive, got {self.rope_theta}")
        if self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps: must be positive, got {self.rms_norm_eps}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window: must be positive or None, got {self.sliding_window}")
        for tok in self.eos_token_ids + ((self.bos_token_id,) if self.bos_token_id is not None else ()):
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"bos/eos token id {tok} outside vocab_size {self.vocab_size}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (H // KVH)."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Inverse of `to_dict` (used by jaxkv's own checkpoint format)."""
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{key}: missing from config")
    return cfg[key]


def _eos_tuple(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    if isinstance(eos, (list, tuple)):
        return tuple(int(e) for e in eos)
    return (int(eos),)


def _rope_scaling_from_hf(rs: Mapping[str, Any] | None) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} (supported: 'llama3')")
    return RopeScaling(
        factor=float(_require(rs, "factor")),
        low_freq_factor=float(_require(rs, "low_freq_factor")),
        high_freq_factor=float(_require(rs, "high_freq_factor")),
        original_max_position_embeddings=int(_require(rs, "original_max_position_embeddings")),
    )


def from_hf_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face ``config.json`` dict."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    arch = None
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            arch = SUPPORTED_ARCHITECTURES[a]
            break
    if arch is None:
        if archs:
            raise ValueError(
                f"architectures: unknown architecture {archs!r}; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type: unknown architecture {model_type!r}; supported: "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
        arch = model_type
    hidden = int(_require(cfg, "hidden_size"))
    heads = int(_require(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim") or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        raise ValueError(f"head_dim: hidden_size {hidden} not divisible by num_attention_heads {heads}")
    if arch == "qwen2":
        bias, out_bias = True, False
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    else:
        bias = out_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if arch == "mistral" else None
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act: unsupported activation {act!r} (supported: 'silu')")
    # transformers 5 writes "rope_parameters" (rope_theta inside); 4.x wrote
    # "rope_theta" and "rope_scaling" at the top level.
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    rope_scaling = rope or cfg.get("rope_scaling")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size")),
        num_layers=int(_require(cfg, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling_from_hf(rope_scaling),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bias,
        attention_out_bias=out_bias,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        sliding_window=int(window) if window else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
    )


GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}


def from_gguf_metadata(meta: Mapping[str, Any], *, vocab_size: int | None = None,
                       tied: bool | None = None) -> ModelConfig:
    """Build a ModelConfig from decoded GGUF metadata (``general.architecture``,
    ``{arch}.block_count``, ...). ``vocab_size`` and ``tied`` come from the tensor
    list when the metadata lacks them (llama.cpp omits ``vocab_size``; tied models
    simply have no ``output.weight`` tensor)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"general.architecture: unknown architecture {arch!r}; supported: "
            f"{sorted(GGUF_ARCHITECTURES)}"
        )

    def get(key, default=None, required=True):
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise ValueError(f"{full}: missing from GGUF metadata")
        return default

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    vocab = vocab_size if vocab_size is not None else get("vocab_size", None, required=False)
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("vocab_size: not in GGUF metadata and no tokenizer.ggml.tokens")
        vocab = len(tokens)
    rope_scaling = None
    if meta.get(f"{arch}.rope.scaling.type") not in (None, "none", "linear") and \
            meta.get(f"{arch}.rope.scaling.type") != "llama3":
        raise ValueError(f"{arch}.rope.scaling.type: unsupported {meta[f'{arch}.rope.scaling.type']!r}")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    window = get("attention.sliding_window", None, required=False)
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=bool(tied) if tied is not None else False,
        attention_bias=arch == "qwen2",
        max_position_embeddings=int(get("context_length", 2048)),
        sliding_window=int(window) if window else None,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_tuple(eos),
    )


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry: `num_pages` pages (page 0 is the trash page) of
    `page_size` tokens each; `kv_dtype` is "float32", "bfloat16" or "int8"."""

    num_pages: int
    page_size: int = 16
    kv_dtype: str = "float32"

    def __post_init__(self):
        if self.num_pages < 2:
            raise ValueError(f"num_pages: need at least 2 (page 0 is reserved), got {self.num_pages}")
        if self.page_size <= 0:
            raise ValueError(f"page_size: must be positive, got {self.page_size}")
        if self.kv_dtype not in ("float32", "bfloat16", "float16", "int8"):
            raise ValueError(f"kv_dtype: unsupported {self.kv_dtype!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    The page pool is `num_pages` pages when given, else sized from
    `kv_cache_memory` bytes, else from `gpu_memory_utilization` of the
    device's free memory where the device reports it, else 1 GiB.
    `max_model_len` caps prompt + output (default: the model's maximum
    positions, or the pool, whichever is smaller).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.8
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    attention_backend: str = "auto"
    dtype: str = "float32"
    kv_dtype: str | None = None  # default: same as dtype
    quantize: str | None = None  # "int8" weight-only; "w8a8" int8 dots for batched CPU steps
    num_decode_steps: int = 8  # decode steps per jitted call when only decodes run
    kv_eviction: str | None = None  # "streaming": attention sinks + a recent window
    streaming_window: int = 1024  # recent tokens kept by "streaming" eviction
    num_sink_tokens: int = 4  # first tokens kept by "streaming" eviction
    seed: int = 0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "num_decode_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.attention_backend not in ("auto", "reference", "pallas"):
            raise ValueError(f"attention_backend: must be 'auto', 'reference' or 'pallas', "
                             f"got {self.attention_backend!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.kv_dtype not in (None, "float32", "bfloat16", "int8"):
            raise ValueError(f"kv_dtype: must be 'float32', 'bfloat16' or 'int8', got {self.kv_dtype!r}")
        if self.quantize not in (None, "int8", "w8a8"):
            raise ValueError(f"quantize: must be None, 'int8' or 'w8a8', got {self.quantize!r}")
        if self.kv_eviction not in (None, "streaming"):
            raise ValueError(f"kv_eviction: must be None or 'streaming', got {self.kv_eviction!r}")
        if self.streaming_window <= 0 or self.num_sink_tokens < 0:
            raise ValueError("streaming_window must be positive and num_sink_tokens >= 0")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
