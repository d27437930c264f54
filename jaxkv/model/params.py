"""The parameter contract between the checkpoint loaders and the model.

Every loader returns ``(config, params)`` with ``params`` a FLAT dict of numpy
arrays named and shaped as `expected_shapes` says. Legend: V vocab, E hidden,
H heads, K kv heads, D head dim, F MLP hidden, L layers; in a sparse layer
(`ModelConfig.layer_sparse`) X experts, Fm each expert's F
(moe_intermediate_size), Fs the shared expert's.

    embed                 [V, E]
    layers.{i}.attn_norm  [E]
    layers.{i}.wq         [E, H, D]     'TE,EHD->THD'
    layers.{i}.wk         [E, K, D]
    layers.{i}.wv         [E, K, D]
    layers.{i}.bq         [H, D]        only when config.attention_bias
    layers.{i}.bk         [K, D]        only when config.attention_bias
    layers.{i}.bv         [K, D]        only when config.attention_bias
    layers.{i}.wo         [H, D, E]     'THD,HDE->TE'
    layers.{i}.bo         [E]           only when config.attention_out_bias
    layers.{i}.q_norm     [D]           only when config.qk_norm
    layers.{i}.k_norm     [D]           only when config.qk_norm
    layers.{i}.sinks      [H]           only when config.attention_sinks
    layers.{i}.k_scale    []            only when config.kv_cache_scales (fp8 KV)
    layers.{i}.v_scale    []            only when config.kv_cache_scales
    layers.{i}.post_attn_norm [E]       only when config.post_norms
    layers.{i}.mlp_norm   [E]
    layers.{i}.w_gate     [E, F]        dense layers
    layers.{i}.w_up       [E, F]        dense layers
    layers.{i}.w_down     [F, E]        dense layers
    layers.{i}.router     [E, X]        sparse layers: 'TE,EX->TX'
    layers.{i}.experts_gate_up [X, E, 2Fm]  gate | up on the last axis
    layers.{i}.experts_down [X, Fm, E]
    layers.{i}.router_bias [X]          only when config.moe_bias (gpt-oss)
    layers.{i}.experts_gate_up_bias [X, 2Fm]  gate | up, as experts_gate_up
    layers.{i}.experts_down_bias [X, E]
    layers.{i}.shared_w_gate [E, Fs]    only when a shared expert (Fs > 0)
    layers.{i}.shared_w_up [E, Fs]
    layers.{i}.shared_w_down [Fs, E]
    layers.{i}.shared_expert_gate [E]   its sigmoid gate's logit 'TE,E->T'
    layers.{i}.post_mlp_norm [E]        only when config.post_norms
    final_norm            [E]
    lm_head               [E, V]        only when not config.tie_word_embeddings
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxkv.config import ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor the model consumes for ``config``."""
    V, E, F = config.vocab_size, config.hidden_size, config.intermediate_size
    H, K, D = config.num_heads, config.num_kv_heads, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed": (V, E)}
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm"] = (E,)
        shapes[p + "wq"] = (E, H, D)
        shapes[p + "wk"] = (E, K, D)
        shapes[p + "wv"] = (E, K, D)
        if config.attention_bias:
            shapes[p + "bq"] = (H, D)
            shapes[p + "bk"] = (K, D)
            shapes[p + "bv"] = (K, D)
        shapes[p + "wo"] = (H, D, E)
        if config.attention_out_bias:
            shapes[p + "bo"] = (E,)
        if config.qk_norm:
            shapes[p + "q_norm"] = (D,)
            shapes[p + "k_norm"] = (D,)
        if config.attention_sinks:
            shapes[p + "sinks"] = (H,)
        if config.kv_cache_scales:
            shapes[p + "k_scale"] = ()
            shapes[p + "v_scale"] = ()
        if config.post_norms:
            shapes[p + "post_attn_norm"] = (E,)
        shapes[p + "mlp_norm"] = (E,)
        if config.layer_sparse(i):
            shapes.update(moe_shapes(config, p))
        else:
            shapes[p + "w_gate"] = (E, F)
            shapes[p + "w_up"] = (E, F)
            shapes[p + "w_down"] = (F, E)
        if config.post_norms:
            shapes[p + "post_mlp_norm"] = (E,)
    shapes["final_norm"] = (E,)
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


def moe_shapes(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The tensors of a sparse layer's MLP (names under prefix `p`)."""
    E, X, Fm, Fs = (
        config.hidden_size,
        config.num_experts,
        config.moe_intermediate_size,
        config.shared_expert_intermediate_size,
    )
    shapes = {
        p + "router": (E, X),
        p + "experts_gate_up": (X, E, 2 * Fm),
        p + "experts_down": (X, Fm, E),
    }
    if config.moe_bias:
        shapes.update(
            {
                p + "router_bias": (X,),
                p + "experts_gate_up_bias": (X, 2 * Fm),
                p + "experts_down_bias": (X, E),
            }
        )
    if Fs:
        shapes.update(
            {
                p + "shared_w_gate": (E, Fs),
                p + "shared_w_up": (E, Fs),
                p + "shared_w_down": (Fs, E),
                p + "shared_expert_gate": (E,),
            }
        )
    return shapes


def check_params(config: ModelConfig, params: Mapping[str, Any]) -> None:
    """Raise ValueError naming every missing, unexpected or wrong-shape tensor."""
    want = expected_shapes(config)
    problems = shape_problems(want, {k: tuple(v.shape) for k, v in params.items()})
    if problems:
        raise ValueError("params do not match the config: " + "; ".join(problems))


def shape_problems(want: Mapping[str, tuple], got: Mapping[str, tuple]) -> list[str]:
    """Missing, unexpected and wrong-shape tensor names, one message each
    kind; empty when `got` matches `want` (name -> shape) exactly."""
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    wrong = sorted(
        f"{k}: expected {want[k]}, got {tuple(got[k])}"
        for k in set(want) & set(got)
        if tuple(got[k]) != tuple(want[k])
    )
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    if wrong:
        problems.append(f"wrong shapes: {wrong}")
    return problems
