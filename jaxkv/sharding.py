"""Scale-out on JAX's SPMD engine: the mesh, and the partition spec of every
parameter and cache array.

    plan = ShardingPlan.make(model_config, tensor_parallel_size=4)
    model = shard_model(model, plan)      # fused layout per shard, placed
    cache = create_cache(plan.model_config(model_config), cache_config,
                         plan.cache_sharding())

The mesh has axes ("data", "model"); tensor parallelism is the "model" axis
(Megatron's split: column-parallel projections into the heads and the MLP,
row-parallel projections out of them, one all-reduce each, which XLA's
partitioner inserts from the shardings below). "data" has size 1 here: data
parallel replicas are not built yet.

The table (t = tensor_parallel_size; shapes in the model's fused layout;
"w" is a Dense's weight, w8 its int8 copy, and scales follow their columns):

    array                    shape             spec             why
    embed                    [V, E]            (None, "model")  (1)
    norms, inv_freq(_local)  [E] / [D], [D/2]  replicated       tiny
    attn.sinks               [H]               ("model",)       a shard's query heads
    attn.wqkv w, w8          [E, t(Hl+2Kl)D]   (None, "model")  column parallel (2)
    attn.wqkv scales, bqkv   [t(Hl+2Kl)D]      ("model",)
    attn.wo w, w8            [H D, E]          ("model", None)  row parallel (3)
    attn.wo scales, bo       [E]               replicated       after the all-reduce
    w_gate_up w, w8          [E, 2F]           (None, "model")  column parallel (2)
    w_gate_up scales         [2F]              ("model",)
    w_down w, w8             [F, E]            ("model", None)  row parallel (3)
    w_down scales            [E]               replicated
    moe router               [E, X]            replicated       every device routes (6)
    experts_gate_up          [X, E, 2Fm]       Fm on "model"    tensor parallel (2, 6)
                                               X on "model"     expert parallel (6)
    experts_down             [X, Fm, E]        Fm / X on "model" likewise
    experts_gate_up_bias     [X, 2Fm]          as experts_gate_up (gpt-oss)
    experts_down_bias        [X, E]            X on "model"     expert parallel;
                                               replicated       tensor parallel (6)
    router_bias              [X]               replicated       every device routes
    shared_w_gate_up, _down  as w_gate_up, w_down                a dense MLP's split
    lm_head w, w8, scales    [E, V], [V]       V on "model"     (4)
    lora a_qkv, a_gate_up    [M, E, parts R]   replicated       (7), per layer
    lora b_q/k/v/gate/up     [M, R, N]         N on "model"     as their base's columns
    lora a_o, a_down; b_     [M, N, R]; [M, R, E]  N on "model"; replicated
    cache k, v (per layer)   [KVH', P, ps, D]  ("model",)       (5)
    cache int8 scales        [KVH', P, ps]     ("model",)       (5)

(1) A row lookup split over E needs no communication; the rows are
    gathered once ([T, E]) for the residual stream, which is replicated.
    Replicated when E % t.
(2) Shard s holds its Hl = H/t query and Kl = KVH'/t KV heads, or its F/t
    gate and up columns: no communication.
(3) Each shard multiplies its heads' (or F/t) slice; one all-reduce of
    [T, E] sums them.
(4) Split over the vocabulary, the largest matrix costs 1/t per device;
    each shard computes its slice of the logits and the logits [S, V]
    (not the weight) are gathered once, so every shard samples the same
    tokens. Replicated when V % t. Tied embeddings use embed's E split: the
    logits are one all-reduce.
(5) Whole KV heads per shard: the cache write and the attention kernel run
    per shard under shard_map, and nothing gathers the cache.
(6) Mixture-of-experts layers run under shard_map (`jaxkv.model.moe`):
    each device's experts (whole experts with `expert_parallel`, else
    every expert's Fm/t slice) and one all-reduce of [T, E]. X % t (expert
    parallel) or Fm % t (tensor parallel) is refused by name. A tensor-
    parallel down bias is whole everywhere and added by device 0 alone.
(7) LoRA slots (`jaxkv.model.lora`) split as their base weights: a
    column-parallel projection's b by its output columns (b_k, b_v with
    the KV heads' replicas), a row-parallel one's a by its input rows.

Fused layout: wqkv and w_gate_up are each one matmul; with t shards their
columns are ordered shard by shard ([q_s, k_s, v_s] for s = 0..t-1, and
[gate_s, up_s]), so a plain split of the columns hands each shard whole
heads and matching gate/up halves. The model reads them back with one
reshape to [T, t, ...] (`Llama.num_shards`).

KV heads: when t exceeds the model's KV heads (SmolLM2 has 3), each KV head
is replicated t / KVH times so that every shard holds one whole head (the
model then runs with KVH' = t KV heads, numerically the same). A split that
cannot give whole heads (H % t, KVH % t when t < KVH, t % KVH when t > KVH,
F % t) is refused with a ValueError naming both numbers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.config import ModelConfig
from jaxkv.shard_columns import gate_up_columns, kv_columns, qkv_columns, take_columns

AXES = ("data", "model")


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> int:
    """The KV heads the model stores when split `tp` ways (KVH, or `tp`
    when KV heads are replicated); raises ValueError when the model
    cannot be split `tp` ways."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size: must be a positive integer, got {tp!r}")
    H, K, F = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if H % tp:
        raise ValueError(
            f"tensor_parallel_size: the model's {H} query heads cannot be split "
            f"over {tp} shards ({H} is not a multiple of {tp})"
        )
    dense = not cfg.num_experts or any(not cfg.layer_sparse(i) for i in range(cfg.num_layers))
    if F % tp and dense:  # an all-expert model (Mixtral) has no dense MLP to split
        raise ValueError(
            f"tensor_parallel_size: the MLP's intermediate size {F} is not a multiple of {tp}"
        )
    if tp <= K:
        if K % tp:
            raise ValueError(
                f"tensor_parallel_size: the model's {K} KV heads cannot be split "
                f"over {tp} shards ({K} is not a multiple of {tp})"
            )
        return K
    if tp % K:
        raise ValueError(
            f"tensor_parallel_size: {tp} shards cannot hold whole copies of the "
            f"model's {K} KV heads ({tp} is not a multiple of {K})"
        )
    return tp


def check_expert_split(cfg: ModelConfig, tp: int, expert_parallel: bool) -> None:
    """Raises ValueError when a mixture of experts cannot be split `tp` ways."""
    if expert_parallel and cfg.num_experts % tp:
        raise ValueError(
            f"enable_expert_parallel: {cfg.num_experts} experts cannot be split "
            f"evenly over tensor_parallel_size={tp} devices"
        )
    if not expert_parallel and cfg.moe_intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size: the experts' intermediate size "
            f"{cfg.moe_intermediate_size} is not divisible by {tp}; "
            f"enable_expert_parallel splits whole experts instead"
        )
    if cfg.shared_expert_intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size: the shared expert's intermediate size "
            f"{cfg.shared_expert_intermediate_size} is not divisible by {tp}"
        )


def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh over the first dp x tp of `devices` (default:
    every device of every process, in jax's order)."""
    devices = list(jax.devices() if devices is None else devices)
    need = tensor_parallel_size * data_parallel_size
    if len(devices) < need:
        raise ValueError(
            f"tensor_parallel_size: {need} devices needed, {len(devices)} available "
            f"({jax.default_backend()}); on CPU, XLA_FLAGS=--xla_force_host_platform_device_"
            f"count={need} before jax starts gives one process {need} devices"
        )
    grid = np.array(devices[:need], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, AXES)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The mesh and what each array's split is (see the module table).
    kv_heads: the KV heads the sharded model stores (KVH, or tp when
    replicated); shard_embed / shard_vocab: whether embed's E and lm_head's
    V split over "model"."""

    mesh: Any  # jax.sharding.Mesh, or an AbstractMesh for lowering only
    tp: int
    kv_heads: int
    model_kv_heads: int
    shard_embed: bool
    shard_vocab: bool
    expert_parallel: bool = False

    @classmethod
    def make(
        cls,
        cfg: ModelConfig,
        tensor_parallel_size: int,
        mesh=None,
        devices=None,
        expert_parallel: bool = False,
    ) -> ShardingPlan:
        tp = tensor_parallel_size
        kv = check_tensor_parallel(cfg, tp)
        if cfg.num_experts:
            check_expert_split(cfg, tp, expert_parallel)
        mesh = make_mesh(tp, 1, devices) if mesh is None else mesh
        if dict(mesh.shape).get("model") != tp:
            raise ValueError(
                f"mesh: its 'model' axis has {dict(mesh.shape).get('model')} "
                f"devices, tensor_parallel_size is {tp}"
            )
        return cls(
            mesh,
            tp,
            kv,
            cfg.num_kv_heads,
            cfg.hidden_size % tp == 0,
            cfg.vocab_size % tp == 0,
            bool(expert_parallel and cfg.num_experts),
        )

    @property
    def kv_replicas(self) -> int:
        """Copies of each of the model's KV heads (1 unless tp > KVH)."""
        return self.kv_heads // self.model_kv_heads

    def model_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config the sharded model runs with (KV heads as stored)."""
        return dataclasses.replace(cfg, num_kv_heads=self.kv_heads)

    def named(self, *spec) -> NamedSharding:
        return NamedSharding(self.mesh, P(*spec))

    @property
    def replicated(self) -> NamedSharding:
        return self.named()

    def cache_sharding(self) -> NamedSharding:
        """Every cache leaf (k, v [KVH', P, ps, D]; scales [KVH', P, ps]) splits its KV heads."""
        return self.named("model")

    def param_spec(self, path: tuple[str, ...]) -> P:
        """The PartitionSpec of the parameter at `path` (names from the
        model's module tree, e.g. ("layers", 3, "attn", "wqkv", "w"))."""
        names = [p for p in path if isinstance(p, str)]
        leaf = names[-1]
        owner = names[-2] if len(names) > 1 else ""
        if leaf == "embed":
            return P(None, "model") if self.shard_embed else P()
        if owner in ("wqkv", "w_gate_up") or (owner == "lm_head" and self.shard_vocab):
            return P(None, "model") if leaf in ("w", "w8") else P("model")
        if leaf in ("bqkv", "sinks"):  # sinks [H]: a shard's query heads are contiguous
            return P("model")
        if owner in ("wo", "w_down"):
            return P("model", None) if leaf in ("w", "w8") else P()
        if leaf in ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias"):
            if self.expert_parallel:
                return P("model")
            return {
                "experts_gate_up": P(None, None, "model"),
                "experts_down": P(None, "model"),
                "experts_gate_up_bias": P(None, "model"),
            }.get(leaf, P())
        if "lora" in names:  # (7)
            return (
                P(None, "model", None)
                if leaf in ("a_o", "a_down")
                else P()
                if leaf[0] == "a" or leaf in ("b_o", "b_down")
                else P(None, None, "model")
            )
        if leaf == "shared_w_gate_up":
            return P(None, "model")
        if leaf == "shared_w_down":
            return P("model")
        return P()  # norms, rotary frequencies, biases after an all-reduce, replicated heads


def shard_model(model, plan: ShardingPlan):
    """A copy of `model` (a `jaxkv.model.llama.Llama` built unsharded, with
    arrays or, for ahead-of-time compiles, jax.ShapeDtypeStructs) in the
    fused layout of `plan.tp` shards, every parameter placed with its
    NamedSharding (abstract ones given it). The input model is unchanged."""
    from flax import nnx

    if getattr(model, "num_shards", 1) != 1:
        raise ValueError("shard_model: the model is already sharded")
    cfg = model.config
    columns = {
        "wqkv": qkv_columns(cfg, plan),
        "w_gate_up": gate_up_columns(cfg.intermediate_size, plan.tp),
    }
    if cfg.num_experts and not plan.expert_parallel:
        columns["experts_gate_up"] = gate_up_columns(cfg.moe_intermediate_size, plan.tp)
        columns["experts_gate_up_bias"] = columns["experts_gate_up"]
    columns["b_k"] = columns["b_v"] = kv_columns(cfg, plan)  # LoRA slots (7)
    if cfg.shared_expert_intermediate_size:
        columns["shared_w_gate_up"] = gate_up_columns(cfg.shared_expert_intermediate_size, plan.tp)

    def place(path, x):
        names = [p for p in path if isinstance(p, str)]
        owner = names[-2] if len(names) > 1 else ""
        cols = columns.get(
            "wqkv" if names[-1] == "bqkv" else names[-1] if names[-1] in columns else owner
        )
        if cols is not None:
            x = take_columns(x, cols)
        sharding = plan.named(*plan.param_spec(path))
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        # From host memory: every process holds the whole value and places
        # its own shards (no single-device copy first).
        return jax.device_put(np.asarray(x), sharding)

    graphdef, state = nnx.split(model)
    state = jax.tree_util.tree_map_with_path(lambda path, x: place(leaf_names(path), x), state)
    model = nnx.merge(graphdef, state)  # new modules: the input model is unchanged
    model.config = plan.model_config(cfg)
    model.num_shards = plan.tp
    model.expert_parallel = plan.expert_parallel
    return model


def leaf_names(path) -> tuple:
    """A state leaf's key path as names ("layers", 0, "attn", "wqkv", "w"),
    without the Variable's own "value" attribute."""
    out = []
    for k in path:
        name = next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), str(k))
        out.append(name)
    return tuple(out[:-1] if out and out[-1] == "value" else out)


def to_host(x) -> np.ndarray:
    """A device array as numpy: the whole array when this process holds it
    all, else this process's copy of a replicated one (several processes)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


def shard_nbytes(tree) -> int:
    """Bytes one device holds of a pytree of sharded arrays (or
    ShapeDtypeStructs with shardings): each leaf's shard size."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shape = x.shape
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total
