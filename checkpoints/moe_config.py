"""The mixture-of-experts fields of a ModelConfig from a Hugging Face
``config.json`` (`checkpoints.hf_config.from_hf_config`), family by
family, with the same rules: an absent value gets the family's default, a
present but invalid one is refused by name."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checkpoints.hf_fields import _bool, _num

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")


def moe_fields(cfg: Mapping[str, Any], arch: str, num_layers: int, intermediate: int) -> dict:
    """The mixture-of-experts fields (none for a dense family): Mixtral's
    and gpt-oss's experts in every layer, renormalized (gpt-oss's softmax
    over the k largest logits is that), gpt-oss with router and expert
    biases and its clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`); Qwen's
    sparse where the layer is not in `mlp_only_layers` and
    (i + 1) % `decoder_sparse_step` == 0."""
    if arch not in MOE_FAMILIES:
        return {}
    key = (
        "num_local_experts"
        if arch in ("mixtral", "gpt_oss") or cfg.get("num_experts") is None
        else "num_experts"
    )
    out = dict(
        num_experts=_num(cfg, key, int, positive=True),
        num_experts_per_tok=_num(cfg, "num_experts_per_tok", int, positive=True),
    )
    if arch == "mixtral":
        return dict(out, moe_intermediate_size=intermediate, norm_topk_prob=True)
    if arch == "gpt_oss":
        return dict(
            out,
            moe_intermediate_size=intermediate,
            norm_topk_prob=True,
            moe_bias=True,
            swiglu_limit=_num(cfg, "swiglu_limit", float, 7.0, positive=True),
            swiglu_alpha=_num(cfg, "swiglu_alpha", float, 1.702, positive=True),
        )
    step = _num(cfg, "decoder_sparse_step", int, 1, positive=True)
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(
        isinstance(i, bool) or not isinstance(i, int) for i in only
    ):
        raise ValueError(f"mlp_only_layers: must be a list of layer indices, got {str(only)[:80]}")
    shared = (
        _num(cfg, "shared_expert_intermediate_size", int, positive=True)
        if arch == "qwen2_moe"
        else 0
    )
    return dict(
        out,
        moe_intermediate_size=_num(cfg, "moe_intermediate_size", int, positive=True),
        norm_topk_prob=_bool(cfg, "norm_topk_prob"),
        shared_expert_intermediate_size=shared,
        sparse_layers=tuple(i not in only and (i + 1) % step == 0 for i in range(num_layers)),
    )
