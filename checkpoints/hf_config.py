"""ModelConfig from a checkpoint's own description: one explicit function per
source, `from_hf_config` here for a Hugging Face ``config.json`` dict and
`checkpoints.gguf_config.from_gguf_metadata` for GGUF key/values. Both raise ValueError naming the
field they cannot use (an unknown architecture, a missing size, an
unsupported RoPE scaling or activation). Only an absent value gets a
default: a present but invalid one (a head count or rope_theta of 0, NaN,
an eos id that is an object, "yes" for a boolean) is refused by name, never
replaced by the default."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from checkpoints.hf_fields import _bool, _num
from checkpoints.moe_config import moe_fields
from jaxkv.model_config import LAYER_TYPES, ModelConfig, RopeScaling

# Hugging Face `architectures` / `model_type` values we can run: all are the
# one decoder; what they differ in (biases, windows per layer, norms, RoPE
# bases, scales, caps, defaults) the ModelConfig fields carry.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text part; the vision tower is not loaded
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
}
# `model_type` -> jaxkv architecture, read when `architectures` is absent.
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
}


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
    if kind == "yarn":
        return _yarn(rs, where, field)
    if kind != "llama3":
        raise ValueError(
            f"{where}: unsupported rope_type {kind!r} (supported: 'llama3', 'linear', 'yarn')"
        )
    return RopeScaling(
        factor=field("factor"),
        low_freq_factor=field("low_freq_factor"),
        high_freq_factor=field("high_freq_factor"),
        original_max_position_embeddings=field("original_max_position_embeddings", int),
    )


def _yarn(rs: Mapping[str, Any], where: str, field) -> RopeScaling:
    """YaRN's fields; its cos / sin factor `attention_factor` when given,
    else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both
    are, else mscale(factor) = 0.1 ln(factor) + 1 (1 for factor <= 1)."""
    factor = field("factor")
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    beta = {
        k: _num(rs, k, float, d, name=f"{where}.{k}", positive=True)
        for k, d in (("beta_fast", 32.0), ("beta_slow", 1.0))
    }
    attn = _num(
        rs, "attention_factor", float, None, name=f"{where}.attention_factor", positive=True
    )
    if attn is None:
        m, m_all = (
            _num(rs, k, float, None, name=f"{where}.{k}") for k in ("mscale", "mscale_all_dim")
        )
        attn = mscale(m) / mscale(m_all) if m and m_all else mscale(1.0)
    return RopeScaling(
        factor=factor,
        rope_type="yarn",
        attention_factor=attn,
        original_max_position_embeddings=field("original_max_position_embeddings", int),
        truncate=_bool(rs, "truncate", True, name=f"{where}.truncate"),
        **beta,
    )


def _family(cfg: Mapping[str, Any]) -> str:
    """The jaxkv architecture of an HF config, from `architectures` or else
    `model_type`; ValueError naming the field and the supported list."""
    archs = cfg.get("architectures")
    if archs is not None and (
        not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)
    ):
        raise ValueError(f"architectures: must be a list of class names, got {str(archs)[:80]}")
    arch = next(
        (SUPPORTED_ARCHITECTURES[a] for a in archs or () if a in SUPPORTED_ARCHITECTURES), None
    )
    if arch is not None:
        return arch
    if archs:
        raise ValueError(
            f"architectures: unknown architecture {archs!r}; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(
            f"model_type: unknown architecture {str(model_type)[:80]!r}; supported: "
            f"{sorted(HF_MODEL_TYPES)}"
        )
    return HF_MODEL_TYPES[model_type]


def _text_part(cfg: Mapping[str, Any]) -> dict:
    """Gemma 3's multimodal config: its `text_config`, with the token ids
    and tying kept from the top level where the text part lacks them."""
    text = _object(cfg, "text_config")
    if text is None:
        raise ValueError("text_config: missing from a gemma3 multimodal config")
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def _rope(cfg: Mapping[str, Any], arch: str) -> tuple[float, RopeScaling | None, float | None]:
    """(rope_theta, rope_scaling, rope_local_theta). transformers 5 writes
    "rope_parameters" (rope_theta inside; for Gemma 3 one object per layer
    type); 4.x wrote "rope_theta" and "rope_scaling" at the top level, and
    Gemma 3's "rope_local_base_freq"."""
    rope = _object(cfg, "rope_parameters") or {}
    default_theta = {"gemma3": 1e6, "gpt_oss": 150000.0}.get(arch, 10000.0)
    local = None
    if set(rope) & {"full_attention", "sliding_attention"}:  # keyed by layer type
        extra = sorted(set(rope) - {"full_attention", "sliding_attention"})
        if extra:
            raise ValueError(f"rope_parameters: unknown layer types {extra}")
        full = _object(rope, "full_attention") or {}
        slide = _object(rope, "sliding_attention")
        if slide is not None:
            if slide.get("rope_type", "default") != "default":
                raise ValueError(
                    f"rope_parameters.sliding_attention: unsupported rope_type "
                    f"{slide.get('rope_type')!r} (supported: 'default')"
                )
            local = _num(
                slide,
                "rope_theta",
                float,
                10000.0,
                name="rope_parameters.sliding_attention.rope_theta",
                positive=True,
            )
        theta = _num(
            full,
            "rope_theta",
            float,
            default_theta,
            name="rope_parameters.full_attention.rope_theta",
            positive=True,
        )
        full.pop("rope_theta", None)
        scaling = _rope_scaling_from_hf(full, "rope_parameters.full_attention")
    elif rope.get("rope_theta") is not None:
        theta = _num(rope, "rope_theta", float, name="rope_parameters.rope_theta", positive=True)
        rope.pop("rope_theta")
        scaling = _rope_scaling_from_hf(rope, "rope_parameters")
    else:
        theta = _num(cfg, "rope_theta", float, default_theta, positive=True)
        rope.pop("rope_theta", None)
        scaling = (
            _rope_scaling_from_hf(rope, "rope_parameters")
            if rope
            else _rope_scaling_from_hf(_object(cfg, "rope_scaling"), "rope_scaling")
        )
    if arch == "gemma3" and local is None:
        local = _num(cfg, "rope_local_base_freq", float, 10000.0, positive=True)
    return theta, scaling, local


def _layer_types(
    cfg: Mapping[str, Any], arch: str, num_layers: int, window: int | None
) -> tuple[str, ...]:
    """Each layer's attention type: the config's `layer_types` when given,
    else the family's pattern (Gemma 2: sliding, full, ...; Gemma 3: five
    sliding then one full, `sliding_window_pattern`; Qwen3: sliding from
    `max_window_layers` on when `use_sliding_window`)."""
    given = cfg.get("layer_types")
    if given is not None:
        if (
            not isinstance(given, list)
            or len(given) != num_layers
            or not all(t in LAYER_TYPES for t in given)
        ):
            raise ValueError(
                f"layer_types: must be a list of {num_layers} of {list(LAYER_TYPES)}, "
                f"got {str(given)[:80]}"
            )
        return tuple(given) if window is not None or "sliding_attention" not in given else ()
    if arch in ("gemma2", "gpt_oss"):
        return tuple(
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
        )
    if arch == "gemma3":
        n = _num(cfg, "sliding_window_pattern", int, None, positive=True)
        n = n or _num(cfg, "_sliding_window_pattern", int, 6, positive=True)
        return tuple(
            "sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)
        )
    if arch == "qwen3" and window is not None:
        first = _num(cfg, "max_window_layers", int, 28)
        return tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        )
    if arch == "qwen2_moe" and window is not None:  # its config class's default pattern
        last = _num(cfg, "max_window_layers", int, 28)
        return tuple(
            "sliding_attention" if (i + 1) % 2 and i < last else "full_attention"
            for i in range(num_layers)
        )
    return ()


def _activation(cfg: Mapping[str, Any], arch: str) -> str:
    gemma = arch.startswith("gemma")
    key = (
        "hidden_activation" if gemma and cfg.get("hidden_activation") is not None else "hidden_act"
    )
    act = cfg.get(key, "gelu_pytorch_tanh" if gemma else "silu")
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in names:
        raise ValueError(
            f"{key}: unsupported activation {str(act)[:40]!r} (supported: {sorted(names)})"
        )
    return names[act]


def from_hf_config(cfg: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face ``config.json`` dict. Absent
    values take the defaults of the family's transformers config class."""
    arch = _family(cfg)
    if arch == "gemma3" and "text_config" in cfg:
        cfg = _text_part(cfg)
    gemma = arch in ("gemma2", "gemma3")
    hidden = _num(cfg, "hidden_size", int)
    heads = _num(cfg, "num_attention_heads", int)
    if heads <= 0:
        raise ValueError(f"num_attention_heads: must be positive, got {heads}")
    kv_heads = _num(cfg, "num_key_value_heads", int, heads, positive=True)
    if heads % kv_heads:
        raise ValueError(
            f"num_key_value_heads: num_attention_heads {heads} is not a multiple of "
            f"num_key_value_heads {kv_heads}"
        )
    head_dim = _num(cfg, "head_dim", int, None, positive=True)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"head_dim: hidden_size {hidden} not divisible by num_attention_heads {heads}"
            )
        head_dim = hidden // heads
    num_layers = _num(cfg, "num_hidden_layers", int)
    window = None
    if arch.startswith("qwen"):  # Qwen2-MoE: q/k/v biases unless qkv_bias is false
        bias = (
            _bool(cfg, "qkv_bias", True)
            if arch == "qwen2_moe"
            else arch == "qwen2" or _bool(cfg, "attention_bias")
        )
        out_bias = False
        if _bool(cfg, "use_sliding_window"):
            window = _num(cfg, "sliding_window", int, None, positive=True)
    else:
        bias = out_bias = _bool(cfg, "attention_bias", arch == "gpt_oss")
        if arch in ("mistral", "mixtral", "gpt_oss") or gemma:
            window = _num(
                cfg,
                "sliding_window",
                int,
                128 if arch == "gpt_oss" else 4096 if gemma else None,
                positive=True,
            )
    if _bool(cfg, "mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported")
    if _bool(cfg, "use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal decoders are supported")
    rope_theta, rope_scaling, rope_local = _rope(cfg, arch)
    caps = {}
    if gemma:
        for key, field, default in (
            ("attn_logit_softcapping", "attn_logit_softcap", 50.0),
            ("final_logit_softcapping", "final_logit_softcap", 30.0),
        ):
            caps[field] = _num(
                cfg,
                key,
                float,
                default if arch == "gemma2" and key not in cfg else None,
                positive=True,
            )
    intermediate = _num(cfg, "intermediate_size", int)
    return ModelConfig(
        architecture=arch,
        vocab_size=_num(cfg, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=_num(cfg, "rms_norm_eps", float, 1e-6, positive=True),
        tie_word_embeddings=_bool(cfg, "tie_word_embeddings", gemma),
        attention_bias=bias,
        attention_out_bias=out_bias,
        max_position_embeddings=_num(cfg, "max_position_embeddings", int, 2048),
        sliding_window=window,
        bos_token_id=_token_id(cfg.get("bos_token_id"), "bos_token_id"),
        eos_token_ids=_eos_tuple(cfg.get("eos_token_id"), "eos_token_id"),
        layer_types=_layer_types(cfg, arch, num_layers, window),
        rope_local_theta=rope_local,
        norm_offset=1.0 if gemma else 0.0,
        post_norms=gemma,
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
        hidden_act=_activation(cfg, arch),
        embed_scale=gemma,
        query_pre_attn_scalar=(
            _num(cfg, "query_pre_attn_scalar", float, 256.0, positive=True) if gemma else None
        ),
        **caps,
        attention_sinks=arch == "gpt_oss",
        **moe_fields(cfg, arch, num_layers, intermediate),
    )
