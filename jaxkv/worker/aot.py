"""Ahead-of-time compiles of the sharded step for hardware this machine
does not have: a TPU slice from libtpu's topology descriptions, or an
abstract mesh of GPUs. Nothing is materialized: the weights and the cache
are jax.ShapeDtypeStructs carrying their NamedShardings, and the Runner's
own jitted programs are lowered from them, so what compiles here is what
an engine on that hardware runs.

    lowered = lower_step(config, mesh, num_pages=..., platform="tpu")
    compiled = lowered.compile()
    compiled.memory_analysis()     # per-device argument / temp bytes
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.config import CacheConfig, ModelConfig
from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import cache_shapes, cache_shardings
from jaxkv.sharding import ShardingPlan, shard_model
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.runner import Runner


def abstract_model(cfg: ModelConfig, dtype: str = "bfloat16"):
    """The Llama of `cfg` with every parameter a jax.ShapeDtypeStruct."""
    from flax import nnx

    from jaxkv.model.llama import Llama

    dt = jnp.dtype(dtype)
    return nnx.eval_shape(lambda: Llama(cfg, lambda name, shape: jnp.zeros(shape, dt)))


def abstract_runner(
    cfg: ModelConfig,
    mesh,
    *,
    num_pages: int,
    page_size: int = 16,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    max_model_len: int = 8192,
    num_decode_steps: int = 8,
    backend: str = "pallas",
    platform: str | None = None,
    num_top_logprobs: int = 20,
    expert_parallel: bool = False,
) -> Runner:
    """A Runner over `mesh` (its "model" axis is the tensor-parallel size)
    whose parameters and cache are abstract: `runner.lower(key)` lowers
    any of its programs, `runner.program_keys()` lists them."""
    tp = dict(mesh.shape)["model"]
    sharding = ShardingPlan.make(cfg, tp, mesh=mesh, expert_parallel=expert_parallel)
    model = shard_model(abstract_model(cfg, dtype), sharding)
    sh = sharding.cache_sharding()
    shapes = cache_shapes(model.config, CacheConfig(num_pages, page_size, kv_dtype or dtype))
    cache = jax.tree_util.tree_map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        cache_shardings(shapes, sh),
    )
    buckets = Buckets.make(
        max_num_seqs, max_num_batched_tokens, -(-max_model_len // page_size), max_model_len
    )
    attention = AttentionSpec(backend, cfg.uniform_window, 0, mesh=mesh, platform=platform)
    return Runner(
        model,
        cache,
        buckets,
        attention,
        max_decode_steps=num_decode_steps,
        num_top_logprobs=num_top_logprobs,
        sharding=sharding,
    )


def lower_step(
    cfg: ModelConfig,
    mesh,
    *,
    kind: str = "mixed",
    tokens: int = 512,
    seqs: int = 64,
    lowering_platforms=None,
    **runner_options,
):
    """The step program (`kind` "mixed" or "decode", `tokens` rows, `seqs`
    sequences) lowered over `mesh` (jax.stages.Lowered)."""
    runner = abstract_runner(cfg, mesh, **runner_options)
    return runner.lower(ProgramKey(kind, tokens, seqs), lowering_platforms)
