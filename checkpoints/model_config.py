"""ModelConfig from a checkpoint's own description: one explicit function per
source, `from_hf_config` for a Hugging Face ``config.json`` dict and
`from_gguf_metadata` for GGUF key/values. Both raise ValueError naming the
field they cannot use (an unknown architecture, a missing size, an
unsupported RoPE scaling or activation). Only an absent value gets a
default: a present but invalid one (a head count or rope_theta of 0, NaN,
an eos id that is an object, "yes" for a boolean) is refused by name, never
replaced by the default."""

from __future__ import annotations

import math
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


def _num(cfg: Mapping[str, Any], key: str, kind, default=_REQUIRED, *, name: str | None = None,
         positive: bool = False):
    """cfg[key] as `kind` (int or float), `default` when it is absent or
    null; ValueError naming the key (or `name`) when required and missing,
    not a number, or (`positive`) not a positive finite number. Only an
    absent value gets the default: a present but invalid one is an error."""
    name = name or key
    v = cfg.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ValueError(f"{name}: missing from config")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (
            kind is int and isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{name}: must be {'an integer' if kind is int else 'a number'}, "
                         f"got {str(v)[:80]}")
    if positive and not 0 < v < math.inf:  # NaN fails the comparison too
        raise ValueError(f"{name}: must be a positive {'integer' if kind is int else 'finite number'}, "
                         f"got {v!r}")
    return kind(v)


def _bool(cfg: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{key}: must be true or false, got {str(v)[:80]}")
    return v


def _object(cfg: Mapping[str, Any], key: str) -> dict | None:
    v = cfg.get(key)
    if v is not None and not isinstance(v, Mapping):
        raise ValueError(f"{key}: must be an object, got {str(v)[:80]}")
    return None if v is None else dict(v)


def _token_id(v: Any, name: str) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name}: must be a token id (a non-negative integer), got {str(v)[:80]}")
    return int(v)


def _eos_tuple(eos: Any, name: str) -> tuple[int, ...]:
    """An eos id or a list of them (HF and GGUF write both) as a tuple."""
    if eos is None:
        return ()
    if isinstance(eos, (list, tuple)):
        if not eos or any(isinstance(e, (list, tuple)) for e in eos):
            raise ValueError(f"{name}: must be a token id or a list of them, got {str(eos)[:80]}")
        return tuple(_token_id(e, name) for e in eos)
    return (_token_id(eos, name),)


def _rope_scaling_from_hf(rs: Mapping[str, Any] | None, where: str) -> RopeScaling | None:
    """RopeScaling from HF's rope_scaling (or rope_parameters, `where`) object."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None

    def field(key, kind=float):
        return _num(rs, key, kind, name=f"{where}.{key}", positive=True)

    if kind == "linear":
        return RopeScaling(factor=field("factor"), rope_type="linear")
    if kind != "llama3":
        raise ValueError(f"{where}: unsupported rope_type {kind!r} "
                         "(supported: 'llama3', 'linear')")
    return RopeScaling(factor=field("factor"), low_freq_factor=field("low_freq_factor"),
                       high_freq_factor=field("high_freq_factor"),
                       original_max_position_embeddings=field("original_max_position_embeddings", int))


def from_hf_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face ``config.json`` dict."""
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise ValueError(f"architectures: must be a list of class names, got {str(archs)[:80]}")
    model_type = cfg.get("model_type")
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs or () if a in SUPPORTED_ARCHITECTURES), None)
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
    kv_heads = _num(cfg, "num_key_value_heads", int, heads, positive=True)
    if heads % kv_heads:
        raise ValueError(f"num_key_value_heads: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv_heads}")
    head_dim = _num(cfg, "head_dim", int, None, positive=True)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"head_dim: hidden_size {hidden} not divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    window = None
    if arch == "qwen2":
        bias, out_bias = True, False
        if _bool(cfg, "use_sliding_window"):
            window = _num(cfg, "sliding_window", int, None, positive=True)
    else:
        bias = out_bias = _bool(cfg, "attention_bias")
        if arch == "mistral":
            window = _num(cfg, "sliding_window", int, None, positive=True)
    if _bool(cfg, "mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act: unsupported activation {act!r} (supported: 'silu')")
    # transformers 5 writes "rope_parameters" (rope_theta inside); 4.x wrote
    # "rope_theta" and "rope_scaling" at the top level.
    rope = _object(cfg, "rope_parameters") or {}
    if rope.get("rope_theta") is not None:
        rope_theta = _num(rope, "rope_theta", float, name="rope_parameters.rope_theta", positive=True)
    else:
        rope_theta = _num(cfg, "rope_theta", float, 10000.0, positive=True)
    rope.pop("rope_theta", None)
    where = "rope_parameters" if rope else "rope_scaling"
    rope_scaling = rope if rope else _object(cfg, "rope_scaling")
    return ModelConfig(
        architecture=arch,
        vocab_size=_num(cfg, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=_num(cfg, "intermediate_size", int),
        num_layers=_num(cfg, "num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling_from_hf(rope_scaling, where),
        rms_norm_eps=_num(cfg, "rms_norm_eps", float, 1e-6),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings"),
        attention_bias=bias,
        attention_out_bias=out_bias,
        max_position_embeddings=_num(cfg, "max_position_embeddings", int, 2048),
        sliding_window=window,
        bos_token_id=_token_id(cfg.get("bos_token_id"), "bos_token_id"),
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id"), "eos_token_id"),
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

    def get(key, kind, default=_REQUIRED):
        """``{arch}.key`` as a positive `kind`; `default` only when absent."""
        full = f"{arch}.{key}"
        if meta.get(full) is None and default is _REQUIRED:
            raise ValueError(f"{full}: missing from GGUF metadata")
        return _num(meta, full, kind, default, positive=True)

    hidden = get("embedding_length", int)
    heads = get("attention.head_count", int)
    kv_heads = get("attention.head_count_kv", int, heads)
    if heads % kv_heads:
        raise ValueError(f"{arch}.attention.head_count_kv: attention.head_count {heads} is not a "
                         f"multiple of attention.head_count_kv {kv_heads}")
    head_dim = get("attention.key_length", int, None)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{arch}.attention.key_length: missing, and embedding_length {hidden} "
                             f"is not divisible by attention.head_count {heads}")
        head_dim = hidden // heads
    vocab = vocab_size if vocab_size is not None else get("vocab_size", int, None)
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise ValueError("vocab_size: not in GGUF metadata and no tokenizer.ggml.tokens")
        vocab = len(tokens)
    rope_scaling = None
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        if meta.get(f"{arch}.rope.scaling.factor") is None:
            raise ValueError(f"{arch}.rope.scaling.factor: missing for linear RoPE scaling")
        rope_scaling = RopeScaling(factor=get("rope.scaling.factor", float), rope_type="linear")
    elif scaling not in (None, "none"):
        raise ValueError(f"{arch}.rope.scaling.type: unsupported {scaling!r} "
                         "(supported: 'none', 'linear')")
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length", int),
        num_layers=get("block_count", int),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=get("rope.freq_base", float, 10000.0),
        rope_scaling=rope_scaling,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", float, 1e-5),
        tie_word_embeddings=bool(tied) if tied is not None else False,
        attention_bias=arch == "qwen2",
        max_position_embeddings=get("context_length", int, 2048),
        sliding_window=get("attention.sliding_window", int, None),
        bos_token_id=_token_id(meta.get("tokenizer.ggml.bos_token_id"), "tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_tuple(meta.get("tokenizer.ggml.eos_token_id"), "tokenizer.ggml.eos_token_id"),
    )
