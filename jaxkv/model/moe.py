"""The mixture-of-experts MLP of a sparse layer (Qwen3-MoE, Qwen2-MoE,
Mixtral, gpt-oss; `ModelConfig.layer_sparse`). Legend as in `jaxkv.model_config`,
plus X experts, k experts per token (`num_experts_per_tok`), Fm each
expert's hidden size, Fs the shared expert's.

Routing, per token: router logits [T, X] = h @ router in float32, softmax
over the X experts, the top k kept; with `norm_topk_prob` the k
probabilities are renormalized to sum to 1 (Mixtral always: the softmax of
the k largest logits is exactly that). Qwen2-MoE adds a shared expert, a
dense SwiGLU MLP every token runs, scaled by sigmoid(h . shared_expert_gate).
gpt-oss (`moe_bias`) adds a bias to the router logits and to each expert's
gate | up and down outputs (its softmax over the k largest logits is the
renormalized form again), and its experts' SwiGLU is clamped
(`ModelConfig.swiglu_limit`, `swiglu`).

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
fixed shapes, but X times the grouped flops. So on CPU, with float32
weights, each group is one MKL sgemm instead (`cpu_gemm.grouped_matmul`,
an FFI custom call; under shard_map too, where each device runs its own):
on one CPU-sized layer (E 512, 64 experts, top 8) 76x, 54x and 36x
ragged_dot at 1, 512 and 1024 tokens (`scripts/bench/moe.py --what gemm`). Expert weights are plain
arrays of the model dtype (weight-only int8 applies to dense layers).

On a mesh (t devices on its "model" axis) the layer runs under shard_map,
in one of two splits (`EngineConfig.enable_expert_parallel`):

- expert parallel: device s holds experts [s X/t, (s+1) X/t) whole. The
  residual stream h is already replicated (attention is tensor parallel
  and ends in an all-reduce), so every device routes every token itself
  and no dispatch moves tokens: a device keeps the (token, choice) rows
  whose expert it holds (the others get a sentinel id that sorts last and
  lie in no group), runs its grouped matmuls, and one all-reduce of
  [T, E] sums the devices' partial outputs: the same single collective as
  a dense tensor-parallel MLP. An all-to-all dispatch pays off only when
  the tokens themselves are split over devices (data-parallel attention),
  which jaxkv does not build; here it would add two exchanges to save
  nothing.
- tensor parallel (the default): every device holds every expert's Fm/t
  slice of gate | up and down (the dense MLP's Megatron split per expert),
  again one all-reduce. It balances work whatever the routing; expert
  parallel gives each device fewer, whole experts (larger groups per
  matmul, no split of a small Fm).

Both hold 1/t of the expert weights per device; the router and its top-k
run replicated (the same numbers on every device), and a shared expert is
split as a dense MLP (column then row parallel) into the same all-reduce.
Expert biases split with their experts under expert parallel; under tensor
parallel the gate | up bias splits with its Fm columns, and the down bias,
whole on every device, is added by device 0 alone (the all-reduce would
otherwise count it t times).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.config import ModelConfig


class MoE(nnx.Module):
    """A sparse layer's MLP; parameters by the flat names of
    `jaxkv.model.params.moe_shapes` under `prefix` ("layers.i")."""

    def __init__(self, config: ModelConfig, prefix: str, init: Callable, quantize: str | None):
        if quantize is not None:
            raise ValueError(
                f"quantize: {quantize!r} is not supported for mixture-of-experts layers "
                f"({config.architecture}); load the model unquantized"
            )
        E, X, Fm, Fs = (
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            config.shared_expert_intermediate_size,
        )
        p = f"{prefix}."
        self.router = nnx.Param(init(p + "router", (E, X)))
        self.experts_gate_up = nnx.Param(init(p + "experts_gate_up", (X, E, 2 * Fm)))
        self.experts_down = nnx.Param(init(p + "experts_down", (X, Fm, E)))
        if Fs:  # gate | up side by side, one matmul, as the dense MLP
            self.shared_w_gate_up = nnx.Param(
                jnp.concatenate(
                    [init(p + "shared_w_gate", (E, Fs)), init(p + "shared_w_up", (E, Fs))], axis=1
                )
            )
            self.shared_w_down = nnx.Param(init(p + "shared_w_down", (Fs, E)))
            self.shared_expert_gate = nnx.Param(init(p + "shared_expert_gate", (E,)))
        if config.moe_bias:
            self.router_bias = nnx.Param(init(p + "router_bias", (X,)))
            self.experts_gate_up_bias = nnx.Param(init(p + "experts_gate_up_bias", (X, 2 * Fm)))
            self.experts_down_bias = nnx.Param(init(p + "experts_down_bias", (X, E)))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.swiglu_limit = config.swiglu_limit
        self.swiglu_alpha = config.swiglu_alpha

    def __call__(
        self, h, act, mesh=None, expert_parallel: bool = False, valid=None, native: bool = False
    ):
        """h [T, E] (normed) -> ([T, E] in h's dtype, routed [X] int32: the
        choices of each expert among the `valid` rows, all when None); under
        `mesh`, split over its "model" axis as the module docstring says;
        `native`: the grouped matmuls through `cpu_gemm.grouped_matmul`
        where the weights are float32."""
        shared = None
        if hasattr(self, "shared_w_gate_up"):
            shared = (
                self.shared_w_gate_up[...],
                self.shared_w_down[...],
                self.shared_expert_gate[...],
            )
        bias = None
        if hasattr(self, "router_bias"):
            bias = (
                self.router_bias[...],
                self.experts_gate_up_bias[...],
                self.experts_down_bias[...],
            )
        fn = functools.partial(
            moe_mlp,
            top_k=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
            act=act,
            return_choices=True,
            swiglu_limit=self.swiglu_limit,
            swiglu_alpha=self.swiglu_alpha,
            native=native,
        )
        args = (
            h,
            self.router[...],
            self.experts_gate_up[...],
            self.experts_down[...],
            shared,
            bias,
        )
        if mesh is None:
            out, choices = fn(*args)
        else:
            from jax.sharding import PartitionSpec as P

            experts = (
                (P("model"), P("model"))
                if expert_parallel
                else (P(None, None, "model"), P(None, "model"))
            )
            shared_spec = None if shared is None else (P(None, "model"), P("model"), P())
            bias_spec = (
                None
                if bias is None
                else (
                    (P(), P("model"), P("model"))
                    if expert_parallel
                    else (P(), P(None, "model"), P())
                )
            )
            body = functools.partial(_moe_shard, fn=fn, expert_parallel=expert_parallel)
            out, choices = jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P(), P(), *experts, shared_spec, bias_spec),
                out_specs=(P(), P()),
                check_vma=False,
            )(*args)
        return out, routed_counts(choices, valid, self.router.shape[1])


def _moe_shard(h, router, gate_up, down, shared, bias, *, fn, expert_parallel: bool):
    """One device's part of `moe_mlp` under shard_map, all-reduced."""
    first = jax.lax.axis_index("model") * gate_up.shape[0] if expert_parallel else 0
    if bias is not None and not expert_parallel:  # the whole down bias: added once, by device 0
        router_bias, gate_up_bias, down_bias = bias
        bias = (
            router_bias,
            gate_up_bias,
            jnp.where(jax.lax.axis_index("model") == 0, down_bias, 0),
        )
    out, choices = fn(h, router, gate_up, down, shared, bias, first_expert=first, partial=True)
    return jax.lax.psum(out, "model").astype(h.dtype), choices  # choices: the same everywhere


def routed_counts(experts, valid, num_experts: int):
    """[X] int32: how many of the rows' choices experts [T, k] went to each
    expert, over the rows where `valid` [T] (all when None)."""
    if valid is not None:
        experts = jnp.where(valid[:, None], experts, num_experts)  # X: counted nowhere
    return jnp.bincount(experts.reshape(-1), length=num_experts + 1)[:num_experts].astype(jnp.int32)


def route(h, router, top_k: int, norm_topk_prob: bool, bias=None):
    """(weights [T, k] float32, experts [T, k] int32) of each token's k
    choices, largest probability first; `bias` [X] adds to the logits."""
    logits = jnp.einsum("TE,EX->TX", h, router, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def swiglu(g, u, act, limit: float | None = None, alpha: float = 1.702):
    """The experts' gated activation: act(g) * u, or with `limit` the
    clamped form (g <= limit, |u| <= limit): (u + 1) * g * sigmoid(alpha g)."""
    if limit is None:
        return act(g) * u
    g, u = jnp.minimum(g, limit), jnp.clip(u, -limit, limit)
    return (u + 1) * (g * jax.nn.sigmoid(g * alpha))


def grouped_experts(
    h,
    experts,
    weights,
    gate_up,
    down,
    act,
    first_expert=0,
    bias=None,
    limit=None,
    alpha=1.702,
    native: bool = False,
):
    """sum_j weights[t, j] * expert_{experts[t, j]}(h[t]): h [T, E],
    experts / weights [T, k], gate_up [X, E, 2Fm], down [X, Fm, E] -> [T, E]
    float32, as grouped matmuls over the rows sorted by expert. With expert
    parallelism `gate_up` / `down` hold experts [first_expert, first_expert
    + X) only, and the choices of other experts add nothing. `bias`:
    (gate_up [X, 2Fm], down [X, E]) of the same experts; `limit`, `alpha`:
    the clamped `swiglu`; `native`: each group one MKL sgemm
    (`cpu_gemm.grouped_matmul`) when h and the weights are float32."""
    T, k = experts.shape
    dot = jax.lax.ragged_dot
    if native and h.dtype == gate_up.dtype == down.dtype == jnp.float32:
        from jaxkv.model import cpu_gemm

        dot = cpu_gemm.grouped_matmul
    X = gate_up.shape[0]
    local = experts.reshape(-1) - first_expert  # [Tk], row r = token r // k, choice r % k
    held = (local >= 0) & (local < X)
    flat = jnp.where(held, local, X)  # X: held elsewhere, sorts last, in no group
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert
    sizes = jnp.bincount(flat, length=X + 1)[:X].astype(jnp.int32)  # [X], rows per expert (0: idle)
    rows = h[order // k]  # [Tk, E]
    gu = dot(rows, gate_up, sizes)  # [Tk, 2Fm]
    ids = jnp.minimum(
        flat[order], X - 1
    )  # each sorted row's expert (rows held elsewhere: masked below)
    if bias is not None:
        gu = gu + bias[0][ids]
    g, u = jnp.split(gu, 2, axis=-1)
    y = dot(swiglu(g, u, act, limit, alpha).astype(h.dtype), down, sizes)  # [Tk, E]
    if bias is not None:
        y = y + bias[1][ids]
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(T * k, dtype=order.dtype))
    y = jnp.where(held[:, None], y[inverse], 0).reshape(T, k, -1)  # (token, choice) order
    return jnp.einsum("TKE,TK->TE", y.astype(jnp.float32), weights)


def moe_mlp(
    h,
    router,
    gate_up,
    down,
    shared=None,
    bias=None,
    *,
    top_k: int,
    norm_topk_prob: bool,
    act,
    first_expert=0,
    partial: bool = False,
    return_choices: bool = False,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
    native: bool = False,
):
    """The sparse layer's MLP: h [T, E] -> [T, E] in h's dtype (float32 and
    this device's part of the sum when `partial`), and each token's experts
    [T, k] too when `return_choices`. `shared`: (w_gate_up [E, 2Fs],
    w_down [Fs, E], gate [E]) of a shared expert; `bias`: (router [X],
    gate_up [X, 2Fm], down [X, E]) biases; `swiglu_limit`, `swiglu_alpha`:
    the experts' clamped `swiglu`; `native`: as `grouped_experts`."""
    weights, experts = route(h, router, top_k, norm_topk_prob, None if bias is None else bias[0])
    out = grouped_experts(
        h,
        experts,
        weights,
        gate_up,
        down,
        act,
        first_expert,
        None if bias is None else bias[1:],
        swiglu_limit,
        swiglu_alpha,
        native,
    )
    if shared is not None:
        w_gate_up, w_down, gate = shared
        g, u = jnp.split(h @ w_gate_up, 2, axis=-1)
        s = (act(g) * u) @ w_down  # [T, E]
        scale = jax.nn.sigmoid(jnp.einsum("TE,E->T", h, gate))[:, None]
        out = out + (scale * s).astype(jnp.float32)
    out = out if partial else out.astype(h.dtype)
    return (out, experts) if return_choices else out
