"""LoRA adapters in the step: PEFT folders read into per-layer low-rank
factors, and the fixed-shape stack of `max_loras` device slots every step
reads.

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
import json
import math
import os
import re

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import ModelConfig

# PEFT module names -> jaxkv's targets, and which are the MLP's.
HF_TARGETS = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
              "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
MLP_TARGETS = ("gate", "up", "down")
# Targets that read one input, whose shrink is one matmul.
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(N_in, N_out) of each projection a LoRA may target in `config`'s
    decoder (the MLP's only when every layer is dense)."""
    E, H, K, D, F = (config.hidden_size, config.num_heads, config.num_kv_heads,
                     config.head_dim, config.intermediate_size)
    shapes = {"q": (E, H * D), "k": (E, K * D), "v": (E, K * D), "o": (H * D, E)}
    if not any(config.layer_sparse(i) for i in range(config.num_layers)):
        shapes.update(gate=(E, F), up=(E, F), down=(F, E))
    return shapes


@dataclasses.dataclass
class LoRAWeights:
    """One adapter read for `config`: per target, a [L, N_in, r] and b
    [L, r, N_out] float32 (scale folded into b; zeros for layers it does not
    touch), r its rank."""

    path: str
    rank: int
    a: dict
    b: dict


def read_adapter(path: str, config: ModelConfig, max_rank: int) -> LoRAWeights:
    """The PEFT adapter in folder `path` for a base model of `config`.
    ValueError naming the problem: a missing file, a rank above `max_rank`,
    a target jaxkv does not apply (embeddings, lm_head, experts, modules_to_
    save, DoRA, biases), or a factor whose shape does not fit the base."""
    from safetensors.numpy import load_file

    cfg_path = os.path.join(str(path), "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"lora: {cfg_path} not found (a PEFT adapter folder holds "
                         "adapter_config.json and adapter_model.safetensors)")
    with open(cfg_path) as f:
        ac = json.load(f)
    if ac.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora: {path}: peft_type {ac.get('peft_type')!r}, only LORA is served")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if ac.get(key) is bad:
            raise ValueError(f"lora: {path}: {key} is not supported")
    if ac.get("modules_to_save"):
        raise ValueError(f"lora: {path}: modules_to_save {ac['modules_to_save']} (whole "
                         "trained modules) are not supported, only low-rank targets")
    if ac.get("bias", "none") != "none":
        raise ValueError(f"lora: {path}: bias {ac['bias']!r} is not supported (only 'none')")
    targets = ac.get("target_modules") or []
    if isinstance(targets, str):
        targets = [] if targets == "all-linear" else [targets]
    unknown = sorted({str(t).split(".")[-1] for t in targets} - set(HF_TARGETS))
    if unknown:
        raise ValueError(f"lora: {path}: unknown target modules {unknown} (jaxkv applies "
                         f"LoRA to {sorted(HF_TARGETS)})")
    st = os.path.join(str(path), "adapter_model.safetensors")
    if not os.path.isfile(st):
        raise ValueError(f"lora: {st} not found")
    tensors = load_file(st)
    shapes = target_shapes(config)
    L = config.num_layers
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, w in tensors.items():
        m = _KEY.search(name)
        if m is None or m.group(2) not in HF_TARGETS:
            raise ValueError(f"lora: {path}: tensor {name!r} targets a module jaxkv does not "
                             f"apply LoRA to (only {sorted(HF_TARGETS)} of the decoder layers)")
        layer, t = int(m.group(1)), HF_TARGETS[m.group(2)]
        if layer >= L:
            raise ValueError(f"lora: {path}: {name!r} is for layer {layer}, the model has {L}")
        if t not in shapes:
            raise ValueError(f"lora: {path}: {name!r}: this model's MLPs include mixtures of "
                             "experts; jaxkv applies LoRA to its attention only")
        found.setdefault((layer, t), {})[m.group(3)] = np.asarray(w, np.float32)
    if not found:
        raise ValueError(f"lora: {path}: no LoRA factors in {st}")
    rank = 0
    a = {t: None for t in shapes}
    b = dict(a)
    for (layer, t), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora: {path}: layer {layer} {t}: lora_A and lora_B must both be "
                             "present")
        A, B = ab["A"], ab["B"]
        n_in, n_out = shapes[t]
        r = A.shape[0]
        if A.ndim != 2 or B.ndim != 2 or A.shape[1] != n_in or B.shape != (n_out, r):
            raise ValueError(f"lora: {path}: layer {layer} {t}: lora_A {list(A.shape)} and "
                             f"lora_B {list(B.shape)} do not fit the base projection "
                             f"[{n_in} in, {n_out} out] (expected [r, {n_in}] and [{n_out}, r])")
        if r > max_rank:
            raise ValueError(f"lora: {path}: rank {r} exceeds max_lora_rank {max_rank}")
        rank = max(rank, r)
        alpha = _pattern(ac.get("alpha_pattern"), layer, t, ac.get("lora_alpha", r))
        scale = alpha / (math.sqrt(r) if ac.get("use_rslora") else r)
        if a[t] is None:
            a[t] = np.zeros((L, n_in, max_rank), np.float32)
            b[t] = np.zeros((L, max_rank, n_out), np.float32)
        a[t][layer, :, :r] = A.T
        b[t][layer, :r] = B.T * scale
    a = {t: x[:, :, :rank] for t, x in a.items() if x is not None}
    b = {t: x[:, :rank] for t, x in b.items() if x is not None}
    return LoRAWeights(str(path), rank, a, b)


def _pattern(patterns, layer: int, t: str, default):
    """A PEFT alpha pattern's value for target t of `layer` (its keys name
    modules in full, by a dotted suffix, or by a regex), else `default`."""
    module = next(k for k, v in HF_TARGETS.items() if v == t)
    full = f"model.layers.{layer}.{'mlp' if t in MLP_TARGETS else 'self_attn'}.{module}"
    for key, v in (patterns or {}).items():
        try:
            hit = full == key or full.endswith("." + key) or re.fullmatch(key, full)
        except re.error:  # not a regex: a name only
            hit = False
        if hit:
            return v
    return default


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
        self.num_slots, self.rank = max_loras, max_rank
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
        return Rows(order, jnp.argsort(order), sizes, jnp.any(lora_slot > 0),
                    jnp.all(key[1:] >= key[:-1]), mask, grouped=mesh is None, native=native)

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
                dot = (_grouped if rows.native and x.dtype == a.dtype == jnp.float32
                       else jax.lax.ragged_dot)
                s = dot(_permuted(x, rows.order, rows.in_order), a, rows.sizes)  # the base's give 0
                ys = [dot(s[:, p * R:(p + 1) * R], b, rows.sizes) for p, b in enumerate(bs)]
            else:
                s = jnp.einsum("TI,MIC->TMC", x, a) * rows.mask[:, :, None]
                ys = [jnp.einsum("TMR,MRO->TO", s[:, :, p * R:(p + 1) * R], b)
                      for p, b in enumerate(bs)]
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
