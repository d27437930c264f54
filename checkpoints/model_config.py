"""ModelConfig from a checkpoint's own description: one explicit function per
source, `from_hf_config` for a Hugging Face ``config.json`` dict and
`from_gguf_metadata` for GGUF key/values. Both raise ValueError naming the
field they cannot use (an unknown architecture, a missing size, an
unsupported RoPE scaling or activation)."""

from __future__ import annotations

from typing import Any, Mapping

from jaxkv.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling

# Hugging Face `architectures` / `model_type` values we can run: all are the
# same decoder (RMSNorm, RoPE, GQA attention, SwiGLU MLP); they differ only in
# biases, windows and defaults, which the config fields carry.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


_REQUIRED = object()


def _require(cfg: Mapping[str, Any], key: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{key}: missing from config")
    return cfg[key]


def _num(cfg: Mapping[str, Any], key: str, kind, default=_REQUIRED):
    """cfg[key] as `kind` (int or float), `default` when it is absent or
    null; ValueError naming the key when required and missing, or not a
    number."""
    v = cfg.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ValueError(f"{key}: missing from config")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            kind is int and isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{key}: must be {'an integer' if kind is int else 'a number'}, "
                         f"got {v!r}")
    return kind(v)


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
    if kind == "linear":
        return RopeScaling(factor=float(_require(rs, "factor")), rope_type="linear")
    if kind != "llama3":
        raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} "
                         "(supported: 'llama3', 'linear')")
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
    hidden = _num(cfg, "hidden_size", int)
    heads = _num(cfg, "num_attention_heads", int)
    if heads <= 0:
        raise ValueError(f"num_attention_heads: must be positive, got {heads}")
    kv_heads = _num(cfg, "num_key_value_heads", int, heads)
    head_dim = _num(cfg, "head_dim", int, 0) or (hidden // heads if hidden % heads == 0 else None)
    if head_dim is None:
        raise ValueError(f"head_dim: hidden_size {hidden} not divisible by num_attention_heads {heads}")
    if arch == "qwen2":
        bias, out_bias = True, False
        window = _num(cfg, "sliding_window", int, None) if cfg.get("use_sliding_window") else None
    else:
        bias = out_bias = bool(cfg.get("attention_bias", False))
        window = _num(cfg, "sliding_window", int, None) if arch == "mistral" else None
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act: unsupported activation {act!r} (supported: 'silu')")
    # transformers 5 writes "rope_parameters" (rope_theta inside); 4.x wrote
    # "rope_theta" and "rope_scaling" at the top level.
    rope = dict(cfg.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", None) or _num(cfg, "rope_theta", float, 10000.0)
    rope_scaling = rope or cfg.get("rope_scaling")
    return ModelConfig(
        architecture=arch,
        vocab_size=_num(cfg, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=_num(cfg, "intermediate_size", int),
        num_layers=_num(cfg, "num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rope_theta=float(rope_theta),
        rope_scaling=_rope_scaling_from_hf(rope_scaling),
        rms_norm_eps=_num(cfg, "rms_norm_eps", float, 1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bias,
        attention_out_bias=out_bias,
        max_position_embeddings=_num(cfg, "max_position_embeddings", int, 2048),
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
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        factor = meta.get(f"{arch}.rope.scaling.factor")
        if factor is None:
            raise ValueError(f"{arch}.rope.scaling.factor: missing for linear RoPE scaling")
        rope_scaling = RopeScaling(factor=float(factor), rope_type="linear")
    elif scaling not in (None, "none"):
        raise ValueError(f"{arch}.rope.scaling.type: unsupported {scaling!r} "
                         "(supported: 'none', 'linear')")
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
