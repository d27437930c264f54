"""ModelConfig from GGUF metadata (llama.cpp's key/values): `from_gguf_metadata`,
with the rules of `checkpoints.hf_config` (only an absent value gets a
default; a present but invalid one is refused by name)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checkpoints.hf_config import _eos_tuple, _token_id
from checkpoints.hf_fields import _REQUIRED, _num
from jaxkv.model_config import ModelConfig, RopeScaling

GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
}
# llama.cpp's layer counts of Gemma 2 27B and Gemma 3 27B, whose attention
# scale is 1/sqrt(hidden / heads) rather than 1/sqrt(head_dim) (their
# query_pre_attn_scalar, which GGUF does not carry; llama.cpp decides by size).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_family(
    get, arch: str, num_layers: int, hidden: int, heads: int, head_dim: int
) -> dict[str, Any]:
    """The per-layer fields of a GGUF file's family (Qwen3's q/k norms,
    Gemma's windows, norms, scales and caps) as ModelConfig keywords."""
    if arch == "qwen3":
        return dict(qk_norm=True)
    if arch not in ("gemma2", "gemma3"):
        return {}
    window = get("attention.sliding_window", int, 4096)
    if arch == "gemma2":
        types = tuple(
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)
        )
    else:
        n = get("attention.sliding_window_pattern", int, 6)
        types = tuple(
            "sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)
        )
    big = num_layers == _GEMMA_27B_LAYERS[arch]
    caps = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}[arch]
    return dict(
        sliding_window=window,
        layer_types=types,
        norm_offset=1.0,
        post_norms=True,
        qk_norm=arch == "gemma3",
        hidden_act="gelu_tanh",
        embed_scale=True,
        query_pre_attn_scalar=float(hidden // heads if big else head_dim),
        rope_local_theta=get("rope.freq_base_swa", float, 10000.0) if arch == "gemma3" else None,
        attn_logit_softcap=get("attn_logit_softcapping", float, caps[0]),
        final_logit_softcap=get("final_logit_softcapping", float, caps[1]),
    )


def from_gguf_metadata(
    meta: Mapping[str, Any], *, vocab_size: int | None = None, tied: bool | None = None
) -> ModelConfig:
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
        raise ValueError(
            f"{arch}.attention.head_count_kv: attention.head_count {heads} is not a "
            f"multiple of attention.head_count_kv {kv_heads}"
        )
    head_dim = get("attention.key_length", int, None)
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"{arch}.attention.key_length: missing, and embedding_length {hidden} "
                f"is not divisible by attention.head_count {heads}"
            )
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
        raise ValueError(
            f"{arch}.rope.scaling.type: unsupported {scaling!r} (supported: 'none', 'linear')"
        )
    num_layers = get("block_count", int)
    family = {
        "sliding_window": get("attention.sliding_window", int, None),
        **_gguf_family(get, arch, num_layers, hidden, heads, head_dim),
    }
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length", int),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=get("rope.freq_base", float, 10000.0),
        rope_scaling=rope_scaling,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", float, 1e-5),
        tie_word_embeddings=bool(tied) if tied is not None else False,
        attention_bias=arch == "qwen2",
        max_position_embeddings=get("context_length", int, 2048),
        bos_token_id=_token_id(
            meta.get("tokenizer.ggml.bos_token_id"), "tokenizer.ggml.bos_token_id"
        ),
        eos_token_ids=_eos_tuple(
            meta.get("tokenizer.ggml.eos_token_id"), "tokenizer.ggml.eos_token_id"
        ),
        **family,
    )
