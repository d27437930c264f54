"""The mixture-of-experts MLP of a sparse layer (Qwen3-MoE, Qwen2-MoE,
Mixtral; `ModelConfig.layer_sparse`). Legend as in `jaxkv.model_config`,
plus X experts, k experts per token (`num_experts_per_tok`), Fm each
expert's hidden size, Fs the shared expert's.

Routing, per token: router logits [T, X] = h @ router in float32, softmax
over the X experts, the top k kept; with `norm_topk_prob` the k
probabilities are renormalized to sum to 1 (Mixtral always: the softmax of
the k largest logits is exactly that). Qwen2-MoE adds a shared expert, a
dense SwiGLU MLP every token runs, scaled by sigmoid(h . shared_expert_gate).

Experts as grouped matmuls. The T k (token, choice) rows are sorted by
expert (a stable argsort of their expert ids); each row is a copy of its
token's h, so each expert's rows are contiguous. `jax.lax.ragged_dot` then
multiplies group g of the rows by expert g's weights, once for gate | up
([Tk, E] x [X, E, 2Fm]) and once for down ([Tk, Fm] x [X, Fm, E]); the rows
go back to (token, choice) order through the inverse permutation and are
summed with their routing weights. Why this form:

- Shapes are fixed: always T k rows, whatever the routing. The routing
  reaches the program only as data (the order and the group sizes [X]),
  so one program per bucket serves every batch, as the step requires.
- No token is dropped: there is no capacity factor. A GShard/Switch-style
  dispatch into [X, C, E] buffers fixes shapes too, but drops the rows past
  C, so outputs would change with the batch and differ from the checkpoint's
  own model; a skewed router (every token to one expert) is exact here.
- Work is the grouped one (each row through its own expert only), not the
  dense one-hot form's (every expert on every token, X / k times the flops).
  Sorting costs O(Tk log Tk) integer work and two row gathers of [Tk, E].

On TPU and GPU `ragged_dot` lowers to a grouped GEMM (XLA's ragged dot, or
jax's Triton kernel on GPU). On CPU jax lowers it to a product over every
expert with the rows of other groups masked to zero: the same numbers,
fixed shapes, but X times the grouped flops; a faster CPU path and expert
parallelism over the mesh are later stages of issue 28. Expert weights are
plain arrays of the model dtype (weight-only int8 applies to dense layers);
under tensor parallelism they are replicated.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.config import ModelConfig


class MoE(nnx.Module):
    """A sparse layer's MLP; parameters by the flat names of
    `jaxkv.model.params.moe_shapes` under `prefix` ("layers.i")."""

    def __init__(self, config: ModelConfig, prefix: str, init: Callable, quantize: str | None):
        if quantize is not None:
            raise ValueError(f"quantize: {quantize!r} is not supported for mixture-of-experts layers "
                             f"({config.architecture}); load the model unquantized")
        E, X, Fm, Fs = (config.hidden_size, config.num_experts, config.moe_intermediate_size,
                        config.shared_expert_intermediate_size)
        p = f"{prefix}."
        self.router = nnx.Param(init(p + "router", (E, X)))
        self.experts_gate_up = nnx.Param(init(p + "experts_gate_up", (X, E, 2 * Fm)))
        self.experts_down = nnx.Param(init(p + "experts_down", (X, Fm, E)))
        if Fs:  # gate | up side by side, one matmul, as the dense MLP
            self.shared_w_gate_up = nnx.Param(jnp.concatenate(
                [init(p + "shared_w_gate", (E, Fs)), init(p + "shared_w_up", (E, Fs))], axis=1))
            self.shared_w_down = nnx.Param(init(p + "shared_w_down", (Fs, E)))
            self.shared_expert_gate = nnx.Param(init(p + "shared_expert_gate", (E,)))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def __call__(self, h, act):
        """h [T, E] (normed) -> [T, E] in h's dtype."""
        shared = None
        if hasattr(self, "shared_w_gate_up"):
            shared = (self.shared_w_gate_up[...], self.shared_w_down[...], self.shared_expert_gate[...])
        return moe_mlp(h, self.router[...], self.experts_gate_up[...], self.experts_down[...],
                       top_k=self.top_k, norm_topk_prob=self.norm_topk_prob, act=act, shared=shared)


def route(h, router, top_k: int, norm_topk_prob: bool):
    """(weights [T, k] float32, experts [T, k] int32) of each token's k
    choices, largest probability first."""
    logits = jnp.einsum("TE,EX->TX", h, router, preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def grouped_experts(h, experts, weights, gate_up, down, act):
    """sum_j weights[t, j] * expert_{experts[t, j]}(h[t]): h [T, E],
    experts / weights [T, k], gate_up [X, E, 2Fm], down [X, Fm, E] -> [T, E]
    float32, as grouped matmuls over the rows sorted by expert."""
    T, k = experts.shape
    X = gate_up.shape[0]
    flat = experts.reshape(-1)  # [Tk], row r = token r // k, choice r % k
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert
    sizes = jnp.bincount(flat, length=X).astype(jnp.int32)  # [X], rows per expert (0: idle)
    rows = h[order // k]  # [Tk, E]
    gu = jax.lax.ragged_dot(rows, gate_up, sizes)  # [Tk, 2Fm]
    g, u = jnp.split(gu, 2, axis=-1)
    y = jax.lax.ragged_dot((act(g) * u).astype(h.dtype), down, sizes)  # [Tk, E]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(T * k, dtype=order.dtype))
    y = y[inverse].reshape(T, k, -1)  # back in (token, choice) order
    return jnp.einsum("TKE,TK->TE", y.astype(jnp.float32), weights)


def moe_mlp(h, router, gate_up, down, *, top_k: int, norm_topk_prob: bool, act, shared=None):
    """The sparse layer's MLP: h [T, E] -> [T, E] in h's dtype. `shared`:
    (w_gate_up [E, 2Fs], w_down [Fs, E], gate [E]) of a shared expert."""
    weights, experts = route(h, router, top_k, norm_topk_prob)
    out = grouped_experts(h, experts, weights, gate_up, down, act)
    if shared is not None:
        w_gate_up, w_down, gate = shared
        g, u = jnp.split(h @ w_gate_up, 2, axis=-1)
        s = (act(g) * u) @ w_down  # [T, E]
        scale = jax.nn.sigmoid(jnp.einsum("TE,E->T", h, gate))[:, None]
        out = out + (scale * s).astype(jnp.float32)
    return out.astype(h.dtype)
