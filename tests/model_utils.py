"""Helpers for model tests: tiny Hugging Face models saved to disk, and a
direct call of the jaxkv model that returns logits at chosen rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.attention import StepBatch
from jaxkv.config import CacheConfig
from jaxkv.kv_cache import create_cache
from jaxkv.runner import Buckets, SeqInput, build_batch


def make_hf_model(kind: str, tmp_path, **overrides):
    """Save a random small HF model of `kind` (llama/qwen2/mistral) and return
    (torch model in eval mode, path)."""
    import torch
    import transformers as tf

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
           "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
           "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[kind]
    torch.manual_seed(0)
    cfg = cls[0](**base)
    cfg._attn_implementation = "eager"
    model = cls[1](cfg).eval()
    with torch.no_grad():  # norms away from 1 so a missing scale shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model, tmp_path


def hf_logits(model, token_ids) -> np.ndarray:
    import torch
    with torch.no_grad():
        out = model(torch.tensor([list(token_ids)]))
    return out.logits[0].float().numpy()


def nan_cache(model_cfg, num_pages, page_size, kv_dtype="float32"):
    """A cache whose every slot is NaN, so a read of an unwritten slot shows."""
    cache = create_cache(model_cfg, CacheConfig(num_pages=num_pages, page_size=page_size,
                                                kv_dtype=kv_dtype))
    return jax.tree_util.tree_map(
        lambda x: jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x, cache)


def step_logits(model, cache, seqs: list[SeqInput], page_size: int, rows_per_seq: bool = False):
    """Run the model once on `seqs`; return (list of logits arrays, cache).
    Each entry is [q_len, V] (every row of the sequence) when rows_per_seq,
    else [V] (its last row)."""
    T = sum(len(s.token_ids) for s in seqs)
    max_pages = max(len(s.block_table) for s in seqs)
    batch, _ = build_batch(seqs, page_size, Buckets((max(T, 1),), (len(seqs),), (max_pages,)))
    if rows_per_seq:
        # One logits row per token: pad the sequence axis of logits_indices
        # to T rows (only cu_q_lens / kv_lens describe the real sequences).
        S = len(seqs)
        idx = np.arange(T, dtype=np.int32)
        pad = T - S
        if pad > 0:
            batch = _pad_seqs(batch, pad)
        batch = StepBatch(**{**batch.__dict__, "logits_indices": idx})
    logits, cache = jax.jit(lambda c, b: model(c, b))(cache, batch)
    logits = np.asarray(logits)
    if rows_per_seq:
        cu = batch.cu_q_lens
        return [logits[cu[i]:cu[i + 1]] for i in range(len(seqs))], cache
    return [logits[i] for i in range(len(seqs))], cache


def _pad_seqs(batch: StepBatch, pad: int) -> StepBatch:
    d = dict(batch.__dict__)
    d["cu_q_lens"] = np.concatenate([d["cu_q_lens"], np.full(pad, d["cu_q_lens"][-1], np.int32)])
    d["kv_lens"] = np.concatenate([d["kv_lens"], np.zeros(pad, np.int32)])
    d["block_tables"] = np.concatenate(
        [d["block_tables"], np.zeros((pad, d["block_tables"].shape[1]), np.int32)])
    return StepBatch(**d)
