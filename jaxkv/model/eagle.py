"""An EAGLE-3 draft head: one decoder layer that reads the target's own
hidden states and proposes tokens (`jaxkv.core.spec.eagle` runs it in the
engine, `jaxkv.training.train_draft` trains it).

The target exposes the inputs of three of its layers (`Llama.aux_layers`,
by default 2, L // 2 and L - 3: id j is the input of layer j) side by side,
f [3 Et]. At position p the head reads the target's features there and
the token at p + 1, and predicts the token at p + 2:

    h = f @ fc                                 (the first step; later steps
                                                read the head's own `pre`)
    x = [rms(embed[token]) ; rms(h)]           [2 E]  (input_norm, hidden_norm)
    a = attention(x @ wqkv, RoPE at p) @ wo    its own KV, one layer
    r = a + h                                  (rms(h) with norm_before_residual)
    pre = r + mlp(rms(r))                      (post_norm; SwiGLU)
    logits = rms(pre) @ lm_head                [Vd]  (final_norm)

A draft vocabulary smaller than the target's maps back through `d2t`:
draft token d is target token d + d2t[d]. The next step reads `pre` as its
hidden state, at position p + 1, with the token just proposed.

Parameters are a flat dict of arrays (a pytree; jitted functions and optax
take it whole), in this project's layout: fc [3 Et, E], input_norm,
hidden_norm, post_norm, final_norm [E], wqkv [2 E, (H + 2 KVH) D],
wo [H D, E], w_gate_up [E, 2 F], w_down [F, E], lm_head [E, Vd],
d2t [Vd] int32, and embed [V, E] when the head has its own (else the
target's table is passed in). `checkpoints.eagle3` reads and writes the
Hugging Face layout other engines use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import ModelConfig
from jaxkv.model.attention import attend
from jaxkv.model.layers import apply_rope, rms_norm, rope_frequencies
from jaxkv.model_config import RopeScaling

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The feature layers a head reads when its config names none: a low,
    the middle and a high layer's inputs."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The head's shape: E hidden, H / KVH heads of D, F intermediate; V the
    target's vocabulary, Vd the head's (<= V); Et the target's hidden size;
    aux_layers the target's feature layers (three)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_before_residual: bool = False
    max_position_embeddings: int = 2048

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        draft_vocab_size: int | None = None,
        aux_layers: tuple[int, ...] | None = None,
    ) -> Eagle3Config:
        """A head shaped like one of the target's layers (as EAGLE-3 heads
        are), reading its default feature layers."""
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            vocab_size=target.vocab_size,
            draft_vocab_size=min(draft_vocab_size or target.vocab_size, target.vocab_size),
            target_hidden_size=target.hidden_size,
            aux_layers=tuple(aux_layers or default_aux_layers(target.num_layers)),
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
        )

    def check_target(self, target: ModelConfig) -> None:
        """ValueError naming what does not fit `target`: its vocabulary,
        its hidden size (the width of the features), its layers."""
        if self.vocab_size != target.vocab_size:
            raise ValueError(
                f"eagle3 head: vocab_size {self.vocab_size} differs from the "
                f"target's vocabulary of {target.vocab_size} tokens"
            )
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"eagle3 head: it reads features of width target_hidden_size "
                f"{self.target_hidden_size}, the target's hidden size is "
                f"{target.hidden_size}"
            )
        if len(self.aux_layers) != 3 or not all(
            0 <= j <= target.num_layers for j in self.aux_layers
        ):
            raise ValueError(
                f"eagle3 head: eagle_aux_hidden_state_layer_ids must be three "
                f"layer ids in 0..{target.num_layers}, got {list(self.aux_layers)}"
            )

    def model_config(self) -> ModelConfig:
        """A one-layer `ModelConfig` of the head's attention (its KV cache,
        RoPE and scale come from it)."""
        return ModelConfig(
            architecture="llama",
            vocab_size=self.draft_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
        )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape (embed optional)."""
        E, F, H, K, D = (
            self.hidden_size,
            self.intermediate_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
        )
        return {
            "fc": (3 * self.target_hidden_size, E),
            "input_norm": (E,),
            "hidden_norm": (E,),
            "wqkv": (2 * E, (H + 2 * K) * D),
            "wo": (H * D, E),
            "post_norm": (E,),
            "w_gate_up": (E, 2 * F),
            "w_down": (F, E),
            "final_norm": (E,),
            "lm_head": (E, self.draft_vocab_size),
            "d2t": (self.draft_vocab_size,),
        }


def random_params(
    cfg: Eagle3Config, seed: int = 0, embed: np.ndarray | None = None, d2t: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Random head weights (norm scales near 1), float32; `d2t` zeros (the
    draft vocabulary is the target's first Vd tokens) unless given."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in cfg.shapes().items():
        if name == "d2t":
            out[name] = np.zeros(shape, np.int32) if d2t is None else np.asarray(d2t, np.int32)
        elif name.endswith("norm"):
            out[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    if embed is not None:
        out["embed"] = np.asarray(embed, np.float32)
    return out


def target_embed(model) -> np.ndarray:
    """The target's embedding table [V, E] as floats (a head without its own)."""
    from jaxkv.model import q8

    if isinstance(model.embed, q8.Q8Table):
        return np.asarray(model.embed.rows(jnp.arange(model.config.vocab_size), jnp.float32))
    return np.asarray(model.embed[...], np.float32)


def target_head(model) -> np.ndarray:
    """The target's output projection [E, V] as floats (the head's start
    in `jaxkv train-draft`)."""
    from jaxkv.model import q8

    cfg = model.config
    if isinstance(model.embed, q8.Q8Table) or (
        cfg.tie_word_embeddings and not hasattr(model, "lm_head")
    ):
        return target_embed(model).T
    eye = jnp.eye(cfg.hidden_size, dtype=model.final_norm[...].dtype)
    return np.asarray(model.lm_head(eye), np.float32)


# ------------------------------------------------------------ the layer's parts


def embed_tokens(params: Mapping[str, Any], embed, tokens):
    """Rows of the head's embedding (its own, else `embed`, the target's [V, E])."""
    table = params["embed"] if "embed" in params else embed
    return table[tokens].astype(params["fc"].dtype)


def layer_inputs(cfg: Eagle3Config, params, emb, hidden, fuse: bool):
    """(x [.., 2 E] for q / k / v, the residual [.., E]) from the token
    embeddings and the hidden states: the target's features [.., 3 Et]
    when `fuse` (through fc), else the head's own `pre`."""
    eps = cfg.rms_norm_eps
    h = hidden @ params["fc"] if fuse else hidden
    hn = rms_norm(h, params["hidden_norm"], eps)
    x = jnp.concatenate([rms_norm(emb, params["input_norm"], eps), hn], axis=-1)
    return x, (hn if cfg.norm_before_residual else h)


def project_qkv(cfg: Eagle3Config, params, x, positions, inv_freq):
    """q [.., H, D], k, v [.., KVH, D] of x [.., 2 E] (q and k rotated to
    `positions`)."""
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = x @ params["wqkv"]
    lead = qkv.shape[:-1]
    q = qkv[..., : H * D].reshape(*lead, H, D)
    k = qkv[..., H * D : (H + K) * D].reshape(*lead, K, D)
    v = qkv[..., (H + K) * D :].reshape(*lead, K, D)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def layer_output(cfg: Eagle3Config, params, o, residual):
    """`pre` [.., E]: the attention output o [.., H D] through wo, the
    residual, and the MLP."""
    F = cfg.intermediate_size
    r = o @ params["wo"] + residual
    gu = rms_norm(r, params["post_norm"], cfg.rms_norm_eps) @ params["w_gate_up"]
    return r + (jax.nn.silu(gu[..., :F]) * gu[..., F:]) @ params["w_down"]


def draft_logits(cfg: Eagle3Config, params, pre):
    """Logits over the draft vocabulary [.., Vd], float32."""
    h = rms_norm(pre, params["final_norm"], cfg.rms_norm_eps)
    return jnp.einsum("...e,ev->...v", h, params["lm_head"], preferred_element_type=jnp.float32)


def to_target(params, draft_ids):
    """Draft vocabulary ids -> the target's (d + d2t[d])."""
    return draft_ids + params["d2t"][draft_ids]


# ------------------------------------------------------------ on the paged cache


def paged_call(
    cfg: Eagle3Config,
    params,
    embed,
    cache,
    batch,
    attention,
    tokens,
    hidden,
    *,
    fuse: bool,
    all_decode: bool | None,
):
    """The head over a ragged batch (a `StepBatch`: positions, slot mapping,
    block tables of the target's pool): writes its K/V into its one-layer
    cache and returns (pre [T, E], cache). tokens [T] target ids; hidden
    [T, 3 Et] (fuse) or [T, E]."""
    mc = cfg.model_config()
    x, residual = layer_inputs(cfg, params, embed_tokens(params, embed, tokens), hidden, fuse)
    inv_freq = jnp.asarray(rope_frequencies(mc))
    q, k, v = project_qkv(cfg, params, x, batch.positions, inv_freq)
    o, cache = attend(
        q, k, v, cache, 0, batch, attention, all_decode=all_decode, sm_scale=mc.sm_scale
    )
    o = o.astype(x.dtype).reshape(o.shape[0], -1)
    return layer_output(cfg, params, o, residual), cache


# ------------------------------------------------------------ training-time test


def unrolled_logits(cfg: Eagle3Config, params, embed, feats, tokens, mask, steps: int):
    """The head unrolled `steps` times over whole sequences, as the engine
    runs it (EAGLE-3's training-time test), for training and offline
    acceptance. feats [B, T, 3 Et] the target's features, tokens [B, T]
    the sequence, mask [B, T] its real rows. Anchor t's step j sits at
    position t + j, reads token t + j + 1 (the sequence's own: in greedy
    decoding the proposals that count are the accepted ones) and the
    hidden state of its step j - 1 (step 0: the features at t), and
    attends to step 0's keys at positions <= t and to its own chain's keys
    of steps 1..j, as the engine's cache holds them. Returns logits
    [steps, B, T, Vd]; step j at anchor t predicts token t + j + 2."""
    B, T = tokens.shape
    H, K, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = H // K
    mc = cfg.model_config()
    inv_freq = jnp.asarray(rope_frequencies(mc))
    scale = mc.sm_scale
    pos = jnp.arange(T)
    causal = (pos[None, :] <= pos[:, None])[None, None, None] & mask[:, None, None, None, :]
    hidden, fuse = feats, True
    keys, outs = [], []  # steps >= 1: each anchor's own k, v [B, T, K, D]
    k0 = v0 = None
    for j in range(steps):
        nxt = jnp.concatenate([tokens[:, j + 1 :], jnp.zeros((B, j + 1), tokens.dtype)], axis=1)
        x, residual = layer_inputs(cfg, params, embed_tokens(params, embed, nxt), hidden, fuse)
        q, k, v = project_qkv(cfg, params, x, pos + j, inv_freq)
        q = q.reshape(B, T, K, G, D)
        if j == 0:
            k0, v0 = k, v
        else:
            keys.append((k, v))
        s0 = jnp.einsum("btkgd,bskd->bkgts", q, k0) * scale  # [B, K, G, T, T]
        s0 = jnp.where(causal, s0, -1e30)
        diag = [jnp.einsum("btkgd,btkd->bkgt", q, kk) * scale for kk, _ in keys]
        m = s0.max(-1)
        for s in diag:
            m = jnp.maximum(m, s)
        p0 = jnp.exp(s0 - m[..., None])
        pd = [jnp.exp(s - m) for s in diag]
        denom = p0.sum(-1) + sum(pd) if pd else p0.sum(-1)
        o = jnp.einsum("bkgts,bskd->btkgd", p0, v0)
        for p, (_, vv) in zip(pd, keys):
            o = o + jnp.einsum("bkgt,btkd->btkgd", p, vv)
        o = o / jnp.moveaxis(denom, -1, 1)[..., None]
        pre = layer_output(cfg, params, o.reshape(B, T, H * D), residual)
        outs.append(draft_logits(cfg, params, pre))
        hidden, fuse = pre, False
    return jnp.stack(outs)
