"""Helpers for model tests: tiny Hugging Face models saved to disk, and a
direct call of the jaxkv model that returns logits at chosen rows."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import CacheConfig
from jaxkv.model.kv_cache import create_cache
from jaxkv.worker.scoring import prefill_logits
from tests.helpers.sharding_worker import FAMILY


def make_hf_model(kind: str, tmp_path, **overrides):
    """Save a random small HF model of `kind` (llama, qwen2, mistral, qwen3,
    gemma2, gemma3: Gemma 3's text model) and return
    (torch model in eval mode, path)."""
    import torch
    import transformers as tf

    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(overrides)
    if kind in ("gemma2", "gemma3"):  # their defaults are a large model's
        base.update(head_dim=16, sliding_window=8, query_pre_attn_scalar=24)
        base.update(overrides)
    cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    }[kind]
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
    cache = create_cache(
        model_cfg, CacheConfig(num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype)
    )
    return jax.tree_util.tree_map(
        lambda x: jnp.full_like(x, jnp.nan) if jnp.issubdtype(x.dtype, jnp.floating) else x, cache
    )


class Seq(NamedTuple):
    """One sequence of a direct model call: its rows' tokens, the position of
    the first, its pages in order."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]


def step_logits(model, cache, seqs: list[Seq], page_size: int, rows_per_seq: bool = False):
    """Run the model once on `seqs`; return (list of logits arrays, cache).
    Each entry is [q_len, V] (every row of the sequence) when rows_per_seq,
    else [V] (its last row)."""
    assert cache.page_size == page_size
    return prefill_logits(model, [tuple(s) for s in seqs], cache, rows_per_seq=rows_per_seq)


WORDS = (
    "the a cache key value page token model step is of and to in it that "
    "what why how fast slow big small red blue one two three four five six "
    "seven eight nine ten yes no hello world sky sea tree run read write"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_tokenizer(path, vocab_size: int = 128):
    """A word-level tokenizer of `vocab_size` ids (specials, the WORDS, then
    filler words) with a chat template, saved as Hugging Face files
    (tokenizer.json, tokenizer_config.json) next to a model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    special = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = special + list(WORDS) + [f"w{i}" for i in range(vocab_size)]
    vocab = {w: i for i, w in enumerate(vocab[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(special)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": CHAT_TEMPLATE,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return path


def greedy_runs(module, tokenizer, prompts, max_tokens: int = 8, top: int = 0):
    """(token ids, their log-probabilities) of each prompt's greedy answer
    from an engine on `module` (prompts run together); with `top`, also each
    step's `top` most likely {token id: log-probability}."""
    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine
    from jaxkv.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=top)
    eng = LLMEngine(module, tokenizer, EngineConfig(warmup=False, num_pages=32, max_num_seqs=4))
    ids = [eng.add_request(p, params) for p in prompts]
    fin = eng.run_to_completion()
    runs = [
        (fin[i].outputs[0].token_ids, [lp.logprob for lp in fin[i].outputs[0].logprobs])
        for i in ids
    ]
    if top:
        return [
            r + ([dict(lp.top) for lp in fin[i].outputs[0].logprobs],) for r, i in zip(runs, ids)
        ]
    return runs


@contextlib.contextmanager
def one_gguf_parse():
    """transformers parses a GGUF's metadata once for the config, again for
    the weights and once more for the tokenizer; with a 262k-token vocabulary
    each parse is about 20 s of Python. Inside this block the parses share one
    `gguf.GGUFReader` per file (a read-only memmap): the same fields, the
    same tensors, one parse."""
    import gguf

    made, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = made(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = made


# A small model of every per-layer feature (Gemma's sliding and global
# layers, soft caps, ...): the hybrid pool's tests' model.
SMALL = dataclasses.replace(
    FAMILY,
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    num_layers=3,
    query_pre_attn_scalar=12.0,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    attn_logit_softcap=4.0,
    final_logit_softcap=6.0,
)


def small_engine(model, **kw):
    """An engine on `model` small enough to preempt, chunk and hit its prefix
    cache within a few requests (`kw` overrides)."""
    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine

    return LLMEngine(
        model,
        None,
        EngineConfig(
            **{
                **dict(
                    warmup=False,
                    num_pages=24,
                    page_size=8,
                    max_num_seqs=8,
                    max_num_batched_tokens=48,
                ),
                **kw,
            }
        ),
    )
