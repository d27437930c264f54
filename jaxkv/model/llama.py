"""The one Flax NNX decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3;
Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss, whose sparse layers' MLP is `jaxkv.model.moe`)
that reads and writes the paged KV cache through StepBatch metadata. What
the families differ in (windows per layer, RoPE bases, norm placement and
convention, q/k norms, activation, scales, soft caps, sinks, biases) comes
from `ModelConfig` (see `jaxkv.model_config`), not from code per family.

Parameters are built from the flat names of `jaxkv.model.params`
(embed [V, E], layers.i.wq [E, H, D], ...), with q/k/v and gate/up fused;
the cache is passed in and returned. GQA: H query heads share KVH kv heads
(MHA when H == KVH, MQA when KVH == 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.config import ModelConfig
from jaxkv.model import cpu_gemm, q8
from jaxkv.model.attention import AttentionSpec, attend, local_view
from jaxkv.model.blocks import BlockDense, BlockWeight
from jaxkv.model.kv_cache import KVCache
from jaxkv.model.layers import (
    activation,
    rms_norm,
    rope_frequencies,
    rope_tables,
    rotate_rope,
    soft_cap,
)
from jaxkv.model.moe import MoE
from jaxkv.model.params import check_params
from jaxkv.model.quant import Dense, rotate_blocks

Init = Callable[[str, tuple], jax.Array]


class Attention(nnx.Module):
    """Projections fused for fewer, larger matmuls (a decode step is bound
    by reading weights): wqkv [E, (H + 2 KVH) D] holds q, k, v side by side."""

    def __init__(self, config: ModelConfig, prefix: str, init: Init, quantize: str | None):
        E, H, K, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        wk = init(f"{prefix}.wk", (E, K, D))  # first: random_init draws in this order
        self.wqkv = _dense(
            [init(f"{prefix}.wq", (E, H, D)), wk, init(f"{prefix}.wv", (E, K, D))], E, quantize
        )
        if config.attention_bias:
            self.bqkv = nnx.Param(
                jnp.concatenate(
                    [
                        init(f"{prefix}.bq", (H, D)).reshape(-1),
                        init(f"{prefix}.bk", (K, D)).reshape(-1),
                        init(f"{prefix}.bv", (K, D)).reshape(-1),
                    ]
                )
            )
        self.wo = _dense([init(f"{prefix}.wo", (H, D, E))], H * D, quantize)
        if config.attention_out_bias:
            self.bo = nnx.Param(init(f"{prefix}.bo", (E,)))
        if config.qk_norm:  # one RMSNorm over D, shared by every head
            self.q_norm = nnx.Param(init(f"{prefix}.q_norm", (D,)))
            self.k_norm = nnx.Param(init(f"{prefix}.k_norm", (D,)))
        if config.attention_sinks:
            self.sinks = nnx.Param(init(f"{prefix}.sinks", (H,)).astype(jnp.float32))
        if config.kv_cache_scales:  # the checkpoint's fp8 KV scales [k, v], read at cache set-up
            self.kv_scale = nnx.Variable(
                jnp.stack([init(f"{prefix}.k_scale", ()), init(f"{prefix}.v_scale", ())]).astype(
                    jnp.float32
                )
            )
        self.bias = config.attention_bias
        self.out_bias = config.attention_out_bias


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, i: int, init: Init, quantize: str | None):
        E, F = config.hidden_size, config.intermediate_size
        p = f"layers.{i}"
        self.attn_norm = nnx.Param(init(f"{p}.attn_norm", (E,)))
        self.attn = Attention(config, p, init, quantize)
        self.mlp_norm = nnx.Param(init(f"{p}.mlp_norm", (E,)))
        if config.post_norms:  # Gemma: the attention's and the MLP's outputs normed too
            self.post_attn_norm = nnx.Param(init(f"{p}.post_attn_norm", (E,)))
            self.post_mlp_norm = nnx.Param(init(f"{p}.post_mlp_norm", (E,)))
        if config.layer_sparse(i):  # a mixture of experts
            self.moe = MoE(config, p, init, quantize)
            return
        # w_gate_up [E, 2F]: gate and up side by side, one matmul.
        self.w_gate_up = _dense(
            [init(f"{p}.w_gate", (E, F)), init(f"{p}.w_up", (E, F))], E, quantize
        )
        self.w_down = _dense([init(f"{p}.w_down", (F, E))], F, quantize)


class Llama(nnx.Module):
    """The decoder. `init(name, shape)` supplies each parameter by its flat
    name; see `from_params` and `random_init`."""

    def __init__(self, config: ModelConfig, init: Init, quantize: str | None = None):
        self.config = config
        V, E = config.vocab_size, config.hidden_size
        embed = init(
            "embed", (V, E)
        )  # a GGUF's Q8_0 blocks, kept (jaxkv.model.q8), never quantized
        self.embed = q8.Q8Table(embed) if isinstance(embed, q8.Q8Blocks) else nnx.Param(embed)
        self.layers = nnx.List([Block(config, i, init, quantize) for i in range(config.num_layers)])
        self.final_norm = nnx.Param(init("final_norm", (E,)))
        if not config.tie_word_embeddings:
            self.lm_head = Dense(init("lm_head", (E, V)), quantize)
        elif quantize == "w8a8":  # an int8 copy of the tied embedding as the head
            self.lm_head = Dense(self.embed[...].T, quantize)
        self.inv_freq = nnx.Variable(jnp.asarray(rope_frequencies(config)))
        if config.rope_local_theta is not None:  # the sliding layers' own base
            self.inv_freq_local = nnx.Variable(jnp.asarray(rope_frequencies(config, local=True)))
        # Tensor-parallel shards the fused wqkv / w_gate_up columns are
        # grouped by (`jaxkv.sharding.shard_model`); 1 unsharded.
        self.num_shards = 1
        self.expert_parallel = False  # experts split whole over the shards (jaxkv.model.moe)
        # An EAGLE-3 head's feature layers (`jaxkv.model.eagle`): id j is the
        # input of layer j (0 the embeddings, L the last layer's output).
        # Set before the model is split; () returns no features.
        self.aux_layers: tuple[int, ...] = ()

    @classmethod
    def from_params(
        cls,
        config: ModelConfig,
        params: Mapping[str, np.ndarray],
        *,
        dtype=jnp.float32,
        quantize: str | None = None,
    ) -> Llama:
        """Build from a flat name -> array dict (checkpoints.* loaders).
        `quantize="int8"`: weight-only int8 matmul weights (jaxkv.quant)."""
        check_params(config, params)
        return cls(config, lambda name, shape: jnp.asarray(params[name], dtype), quantize)

    @classmethod
    def random_init(cls, config: ModelConfig, seed: int = 0, *, dtype=jnp.float32) -> Llama:
        """Random weights (norm scales near 1), for tests and benchmarks."""
        rng = np.random.default_rng(seed)

        def init(name, shape):
            if name.endswith("norm"):  # scale near 1 in either convention (w, 1 + w)
                return jnp.asarray(
                    1.0 - config.norm_offset + 0.1 * rng.standard_normal(shape), dtype
                )
            if name.endswith("sinks"):
                return jnp.asarray(rng.standard_normal(shape), dtype)
            if name.endswith(("k_scale", "v_scale")):  # fp8 KV scales: |k|, |v| up to ~20
                return jnp.asarray(0.05, dtype)
            fan_in = shape[0] if len(shape) > 1 or name.endswith("expert_gate") else 1
            if ".experts_" in name:  # [X, in, out]
                fan_in = shape[1]
            if name.endswith(".wo"):
                fan_in = shape[0] * shape[1]
            std = 0.02 if name == "embed" else 1.0 / np.sqrt(fan_in)
            return jnp.asarray(std * rng.standard_normal(shape), dtype)

        return cls(config, init)

    def kv_cache_scales(self) -> np.ndarray | None:
        """The checkpoint's fp8 KV scales, [L, 2] float32 (k, v of each
        layer; `ModelConfig.kv_cache_scales`), or None."""
        if not self.config.kv_cache_scales:
            return None
        return np.stack([np.asarray(layer.attn.kv_scale[...]) for layer in self.layers])

    def __call__(
        self,
        cache: KVCache,
        batch,
        attention: AttentionSpec,
        *,
        all_decode: bool | None = None,
        features: bool = False,
    ):
        """One ragged step: returns (logits [S, V] float32 at each sequence's
        logits_indices row, updated cache), and with `features` a third
        output: the `aux_layers` inputs side by side, [T, len(aux_layers) E]
        (an EAGLE-3 head reads them). `batch` is a
        `jaxkv.worker.step_batch.StepBatch` (any object with its token,
        position, slot and sequence fields); `attention` the engine's
        attention choice; `all_decode` (static) tells the attention that
        every sequence brings one row (True), that some bring more (False),
        or nothing (None: decided at run time)."""
        cfg = self.config
        H, K, D, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        G = self.num_shards  # columns come in G groups, one per shard
        Hl, Kl = H // G, K // G
        mesh = attention.mesh
        blocks = isinstance(self.embed, q8.Q8Table)
        x = _constrain(
            self.embed.rows(batch.token_ids, self.final_norm[...].dtype)
            if blocks
            else self.embed[...][batch.token_ids],
            mesh,
        )  # [T, E], whole rows everywhere
        if cfg.embed_scale:  # sqrt(E) rounded to the model dtype first, as Gemma does
            x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
        T = x.shape[0]
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        act = activation(cfg.hidden_act)
        # int8 / int4 cache: each head's q, k and v are rotated by normalized
        # Walsh-Hadamard blocks (the largest power of two dividing D: all of
        # D for 64 or 128). A vector's few large channels are spread over
        # the block, so one absmax scale per token and head wastes far less
        # of the int8 range; (q R).(k R) = q.k, and outputs rotate back.
        rot = D & -D
        rotate = cache.rotated(cfg)
        native = cpu_gemm.use_native(T, attention.platform, mesh)  # MKL sgemm on CPU
        # Hybrid pool: the sliding layers read and write their own rings of pages.
        local = (
            local_view(batch, attention.ring_pages, cache.page_size)
            if attention.ring_pages
            else None
        )
        routed = None
        lora = getattr(self, "lora", None)  # adapters in slots (jaxkv.model.lora)
        rows = (
            None if lora is None else lora.rows(batch.lora_slot, x.dtype, mesh, attention.platform)
        )
        feats = {}
        tables = {}  # (local, scale) -> rope_tables, computed once a step
        for i, layer in enumerate(self.layers):
            if features and i in self.aux_layers:
                feats[i] = x
            h = rms_norm(x, layer.attn_norm[...], eps, off)
            a = layer.attn
            qkv = a.wqkv(h, native)  # [T, G (Hl + 2 Kl) D]
            if rows is not None:
                qkv = qkv + lora("qkv", i, h, rows, G)
            if a.bias:
                qkv = qkv + a.bqkv[...]
            qkv = qkv.reshape(T, G, (Hl + 2 * Kl) * D)
            q = qkv[:, :, : Hl * D].reshape(T, H, D)
            k = qkv[:, :, Hl * D : (Hl + Kl) * D].reshape(T, K, D)
            v = qkv[:, :, (Hl + Kl) * D :].reshape(T, K, D)
            if cfg.qk_norm:
                q = rms_norm(q, a.q_norm[...], eps, off)
                k = rms_norm(k, a.k_norm[...], eps, off)
            key = (cfg.local_rope(i), cfg.rope_scale(i))
            if key not in tables:
                inv_freq = (self.inv_freq_local if key[0] else self.inv_freq)[...]
                tables[key] = rope_tables(batch.positions, inv_freq, key[1])
            q, k = rotate_rope(q, tables[key]), rotate_rope(k, tables[key])
            if rotate:  # q.k unchanged; int8 loses less to outlier channels
                q, k, v = (rotate_blocks(t, rot).astype(t.dtype) for t in (q, k, v))
            window = cfg.layer_window(i)
            o, cache = attend(
                q,
                k,
                v,
                cache,
                i,
                local if i in attention.local_layers else batch,
                attention,
                all_decode=all_decode,
                soft_cap=cfg.attn_logit_softcap,
                sm_scale=cfg.sm_scale,
                window=window,
                sinks=a.sinks[...] if cfg.attention_sinks else None,
            )
            if rotate:  # values were rotated: rotate the output back
                o = rotate_blocks(o, rot)
            o = o.astype(x.dtype)
            o = o.reshape(-1, H * D)
            o = a.wo(o, native) + (0 if rows is None else lora("o", i, o, rows))  # [T, E]
            if a.out_bias:
                o = o + a.bo[...]
            if cfg.post_norms:
                o = rms_norm(o, layer.post_attn_norm[...], eps, off)
            x = x + o
            h = rms_norm(x, layer.mlp_norm[...], eps, off)
            if hasattr(
                layer, "moe"
            ):  # routed counts over the rows that are tokens (not the trash page's)
                m, n = layer.moe(
                    h,
                    act,
                    mesh,
                    self.expert_parallel,
                    batch.slot_mapping >= cache.page_size,
                    cpu_gemm.use_native_grouped(attention.platform),
                )
                routed = n if routed is None else routed + n
            else:
                gu = layer.w_gate_up(h, native)
                if rows is not None:
                    gu = gu + lora("gate_up", i, h, rows, G)
                gu = gu.reshape(T, G, 2, F // G)  # [T, G [gate, up] F/G]
                g, u = gu[:, :, 0].reshape(T, F), gu[:, :, 1].reshape(T, F)
                m = act(g) * u
                m = layer.w_down(m, native) + (0 if rows is None else lora("down", i, m, rows))
            if cfg.post_norms:
                m = rms_norm(m, layer.post_mlp_norm[...], eps, off)
            x = x + m
        if routed is not None and cache.routed is not None:
            cache = dataclasses.replace(cache, routed=cache.routed + routed)
        if features:
            feats[cfg.num_layers] = x
            aux = jnp.concatenate([feats[j] for j in self.aux_layers], axis=-1)
        h = x[batch.logits_indices]  # [S, E]
        h = rms_norm(h, self.final_norm[...], eps, off)
        if blocks:
            logits = self.embed.head(h, q8.use_native(attention.platform, mesh))
        elif cfg.tie_word_embeddings and not hasattr(self, "lm_head"):
            logits = jnp.einsum("SE,VE->SV", h, self.embed[...], preferred_element_type=jnp.float32)
        else:
            logits = self.lm_head(h).astype(jnp.float32)
            if mesh is not None and cfg.vocab_size % mesh.shape["model"] == 0:
                # Each shard its slice of V from its slice of lm_head, so
                # the logits [S, V] move rather than the weight [E, V].
                logits = _constrain(logits, mesh, None, "model")
        logits = soft_cap(logits, cfg.final_logit_softcap)
        if features:
            return _constrain(logits, mesh), cache, _constrain(aux, mesh)
        return _constrain(logits, mesh), cache  # every shard samples from all of V


def _dense(parts, n_in: int, quantize):
    """One projection over `parts` side by side (q, k, v; gate, up): a
    `Dense` of their concatenation, or a `BlockDense` where a part is a
    GGUF file's blocks (`jaxkv.model.blocks`)."""
    if any(isinstance(p, BlockWeight) for p in parts):
        return BlockDense([p if isinstance(p, BlockWeight) else p.reshape(n_in, -1) for p in parts])
    flat = [p.reshape(n_in, -1) for p in parts]
    return Dense(flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=1), quantize)


def _constrain(x, mesh, *spec):
    """x laid out over `mesh` as PartitionSpec(*spec) (replicated when no
    spec); x itself without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(
        x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    )
