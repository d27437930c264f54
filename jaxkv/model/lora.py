"""LoRA adapters in the step: the fixed-shape stack of `max_loras` device
slots every step reads (PEFT folders are read into per-layer low-rank
factors by `checkpoints.peft_adapter`).

A PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`) holds,
for each targeted projection of each layer, lora_A [r, N_in] and lora_B
[N_out, r]; the projection's output gains (x A^T) B^T * scale, scale =
lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). jaxkv reads the seven
projections every family of its decoder has: q, k, v, o and gate, up, down
(the MLP ones on dense layers only; a mixture of experts' layers take
attention adapters).

`LoRAStack` holds, per target t, a_t [L, M, N_in, R] and b_t [L, M, R,
N_out] (M slots of rank R = max_lora_rank; an adapter of lower rank
zero-padded, its scale folded into b; the a of targets reading one input
side by side, one matmul: `GROUPS`). Each row of a step carries its slot
(`StepBatch.lora_slot`, 0: the base model, m + 1: slot m). On one device
the rows are sorted by slot once per step and each projection's update is
two grouped matmuls, each row through its own slot's factors only (the
base model's rows through none):

    delta[rows of m] = (x[rows of m] @ a_t[l, m]) @ b_t[l, m]

(`jax.lax.ragged_dot`; on CPU each group one MKL sgemm,
`jaxkv.model.cpu_gemm.grouped_matmul`). Under a mesh, where GSPMD splits
plain dots, every row runs through every slot with the others masked out
(M times the grouped flops). Either way a step has one shape whatever mix
of adapters it holds, and loading an adapter only replaces the stack's
arrays (no program compiles). Under tensor parallelism a and b split like
their base weight (`jaxkv.sharding.ShardingPlan.param_spec`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv.config import ModelConfig

# PEFT module names -> jaxkv's targets, and which are the MLP's.
HF_TARGETS = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
MLP_TARGETS = ("gate", "up", "down")
# Targets that read one input, whose shrink is one matmul.
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N_in, N_out) of each projection a LoRA may target in `config`'s
    decoder (the MLP's only when every layer is dense)."""
    E, H, K, D, F = (
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
    )
    shapes = {"q": (E, H * D), "k": (E, K * D), "v": (E, K * D), "o": (H * D, E)}
    if not any(config.layer_sparse(i) for i in range(config.num_layers)):
        shapes.update(gate=(E, F), up=(E, F), down=(F, E))
    return shapes


def stack_shapes(config: ModelConfig, max_loras: int, max_rank: int) -> dict[str, tuple]:
    """Every `LoRAStack` array's shape: a_g [L, M, N_in, parts R] per group g
    of targets that read one input (`GROUPS`: one shrink matmul for q, k and
    v, their factors side by side), b_t [L, M, R, N_out] per target."""
    shapes, L, M, R = target_shapes(config), config.num_layers, max_loras, max_rank
    out = {}
    for g, parts in GROUPS.items():
        if parts[0] in shapes:
            out[f"a_{g}"] = (L, M, shapes[parts[0]][0], len(parts) * R)
            out.update({f"b_{t}": (L, M, R, shapes[t][1]) for t in parts})
    return out


def a_columns(t: str, rank: int) -> slice:
    """Where target t's factor sits in the last axis of its group's a."""
    g = next(g for g, parts in GROUPS.items() if t in parts)
    first = GROUPS[g].index(t) * rank
    return slice(first, first + rank)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rows:
    """A step's rows by slot, found once per step: `order` [T] sorts them
    by slot (the base model's rows last), `back` [T] undoes it, `sizes` [M]
    counts each slot's, `used` [] whether any row has a slot, `in_order` []
    whether they are sorted already,
    `mask` [T, M] (the masked form: under a mesh) one-hot of each row's."""

    order: Any
    back: Any
    sizes: Any
    used: Any
    in_order: Any
    mask: Any
    grouped: bool = dataclasses.field(metadata=dict(static=True))
    native: bool = dataclasses.field(metadata=dict(static=True))


class _Layer(nnx.Module):
    def __init__(self, shapes: dict, dtype):
        for name, shape in shapes.items():
            setattr(self, name, nnx.Param(jnp.zeros(shape[1:], dtype)))


class LoRAStack(nnx.Module):
    """The device slots: `stack_shapes`' arrays, zeros until an adapter is
    written (see the module's text), one array per layer (`layers[l]`, as
    the base weights: a layer's factors feed its matmuls with no copy)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype=jnp.float32):
        self.num_slots = max_loras
        self.rank = max_rank
        shapes = stack_shapes(config, max_loras, max_rank)
        self.groups = tuple(g for g in GROUPS if f"a_{g}" in shapes)
        self.layers = nnx.List([_Layer(shapes, dtype) for _ in range(config.num_layers)])

    def rows(self, lora_slot, dtype, mesh, platform: str | None) -> Rows:
        """How a step with rows' slots lora_slot [T] (0: none) computes its
        updates: grouped by slot on one device (each row through its own
        slot's factors; on CPU each group one MKL sgemm), masked over every
        slot under a mesh (GSPMD splits plain dots)."""
        from jaxkv.model import cpu_gemm

        M = self.num_slots
        key = jnp.where(lora_slot > 0, lora_slot - 1, M)
        sizes = jnp.sum(key[None, :] == jnp.arange(M)[:, None], axis=1).astype(jnp.int32)
        order = jnp.argsort(key, stable=True)
        mask = (key[:, None] == jnp.arange(M)[None, :]).astype(dtype)
        native = cpu_gemm.use_native_grouped(platform) and dtype == jnp.float32
        return Rows(
            order,
            jnp.argsort(order),
            sizes,
            jnp.any(lora_slot > 0),
            jnp.all(key[1:] >= key[:-1]),
            mask,
            grouped=mesh is None,
            native=native,
        )

    def __call__(self, g: str, i: int, x, rows: Rows, groups: int = 1):
        """Layer i's update of target group g (`GROUPS`) for rows x [T, N_in]:
        [T, N_out] in the fused projection's column layout (G `groups`, one
        per tensor-parallel shard, each the parts' shard slices side by
        side); 0 where the stack has no such group."""
        if g not in self.groups:
            return 0
        parts, T, R = GROUPS[g], x.shape[0], self.rank
        layer = self.layers[i]
        a = getattr(layer, f"a_{g}")[...]  # [M, N_in, parts R]
        bs = [getattr(layer, f"b_{t}")[...] for t in parts]  # [M, R, N_out]

        def update(x):
            if rows.grouped:
                dot = (
                    _grouped
                    if rows.native and x.dtype == a.dtype == jnp.float32
                    else jax.lax.ragged_dot
                )
                s = dot(_permuted(x, rows.order, rows.in_order), a, rows.sizes)  # the base's give 0
                ys = [dot(s[:, p * R : (p + 1) * R], b, rows.sizes) for p, b in enumerate(bs)]
            else:
                s = jnp.einsum("TI,MIC->TMC", x, a) * rows.mask[:, :, None]
                ys = [
                    jnp.einsum("TMR,MRO->TO", s[:, :, p * R : (p + 1) * R], b)
                    for p, b in enumerate(bs)
                ]
            y = jnp.concatenate([y.reshape(T, groups, -1) for y in ys], axis=2).reshape(T, -1)
            if rows.grouped:  # row order again (a gather: no slow scatter)
                y = _permuted(y, rows.back, rows.in_order)
            return y.astype(x.dtype)

        # A step where no row names an adapter skips the update (no gathers, no matmuls).
        width = sum(b.shape[-1] for b in bs)
        return jax.lax.cond(rows.used, update, lambda x: jnp.zeros((T, width), x.dtype), x)


def _permuted(x, order, in_order):
    """x[order], skipped where the rows are in slot order already (a
    prefill chunk of one sequence, say): the gathers cost 20% of a
    prefill with adapters on CPU."""
    return jax.lax.cond(in_order, lambda x: x, lambda x: x[order], x)


def _grouped(x, w, sizes):
    from jaxkv.model import cpu_gemm

    return cpu_gemm.grouped_matmul(x, w, sizes)
