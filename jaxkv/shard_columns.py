"""Column orders of the fused, sharded layout (`jaxkv.sharding`): which
unsharded column each stored column of wqkv, gate | up and a LoRA slot's
k / v factors holds, shard by shard. `cfg` is a `ModelConfig`, `plan` a
`jaxkv.sharding.ShardingPlan`."""

from __future__ import annotations

import jax
import numpy as np


def qkv_columns(cfg, plan) -> np.ndarray:
    """Column order of the sharded wqkv in terms of the unsharded one
    ([q (H D) | k (KVH D) | v (KVH D)]): shard by shard, each shard's query
    heads, then its KV heads (a replicated head's columns repeat)."""
    H, K, D, t = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, plan.tp
    kv_of = np.arange(plan.kv_heads) // plan.kv_replicas  # stored KV head -> model's
    Hl, Kl = H // t, plan.kv_heads // t
    cols = []
    for s in range(t):
        cols.append(heads(0, np.arange(s * Hl, (s + 1) * Hl), D))
        kv = kv_of[s * Kl : (s + 1) * Kl]
        cols.append(heads(H * D, kv, D))
        cols.append(heads((H + K) * D, kv, D))
    return np.concatenate(cols)


def heads(first: int, ids: np.ndarray, D: int) -> np.ndarray:
    """The columns of heads `ids` (D each) of a block starting at column `first`."""
    return (first + ids[:, None] * D + np.arange(D)).reshape(-1)


def kv_columns(cfg, plan) -> np.ndarray:
    """Columns of the stored KV heads (replicas repeat) in a [KVH D] block."""
    return heads(0, np.arange(plan.kv_heads) // plan.kv_replicas, cfg.head_dim)


def gate_up_columns(F: int, tp: int) -> np.ndarray:
    """Column order of a sharded gate | up weight ([gate F | up F] unsharded)."""
    Fl = F // tp
    return np.concatenate(
        [np.r_[s * Fl : (s + 1) * Fl, F + s * Fl : F + (s + 1) * Fl] for s in range(tp)]
    )


def take_columns(x, cols: np.ndarray):
    """x [..., N] -> x[..., cols]; shapes only for a jax.ShapeDtypeStruct."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[:-1] + (len(cols),), x.dtype)
    return np.asarray(x)[..., cols]
