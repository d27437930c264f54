"""Quality checks on a model: greedy agreement between two engine set-ups
and the mean log-likelihood of a fixed text (used by scripts/bench/quality.py and
the int8 KV tests), through jaxkv's public API."""

from __future__ import annotations

import numpy as np

from jaxkv import LLMEngine, SamplingParams
from jaxkv.config import EngineConfig
from jaxkv.worker.scoring import sequence_logits

QUESTIONS = [
    "What is a KV cache?",
    "Name three planets.",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is 17 times 3?",
    "Explain recursion to a child.",
    "Translate 'good morning' into French.",
    "What does a compiler do?",
    "List four prime numbers.",
    "Who wrote Hamlet?",
    "Describe a cat in one sentence.",
    "What is photosynthesis?",
    "How do I sort a list in Python?",
    "What is the capital of Japan?",
    "Tell me a fun fact about octopuses.",
]

TEXT = (
    "The key-value cache stores the keys and values of every token a model has already "
    "seen, so that each new token only needs to compute its own query, key and value. "
    "Without it, generating a long answer would recompute attention over the whole "
    "prefix at every step, and the cost of decoding would grow quadratically."
)


def chat_ids(tok, question):
    """The question in the model's chat template, or as plain text with a
    "Question: ... Answer:" frame for a base model that has none."""
    try:
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True
        )
    except ValueError:
        return tok.encode(f"Question: {question}\nAnswer:")
    return tok.encode(text, add_special_tokens=False)


def greedy_outputs(model, tok, n_prompts=16, max_tokens=64, **engine_opts):
    """Greedy token ids of the first n_prompts chat prompts (ignore_eos)."""
    opts = dict(
        num_pages=256, page_size=16, max_num_seqs=8, max_num_batched_tokens=64, warmup=False
    )
    eng = LLMEngine(model, tok, EngineConfig(**{**opts, **engine_opts}))
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [
        eng.add_request({"prompt_token_ids": chat_ids(tok, q)}, sp) for q in QUESTIONS[:n_prompts]
    ]
    out = eng.run_to_completion()
    return [out[i].outputs[0].token_ids for i in ids]


def mean_loglik(model, tok, kv_dtype="float32"):
    """Mean log p(token | prefix) over TEXT, one prefill through the paged cache."""
    ids = tok.encode(TEXT)
    (logits,) = sequence_logits(model, [ids], kv_dtype=kv_dtype)
    logits = logits.astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    lp = logits[np.arange(len(ids) - 1), ids[1:]] - lse[:-1]
    return float(lp.mean())


def agreement(a, b):
    """(prompts whose whole output is identical, mean fraction of positions
    equal before the first difference)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        prefix.append(n / len(x))
    return same, float(np.mean(prefix))


def teacher_forced_agreement(model, tok, outputs, kv_dtype="float32"):
    """Fraction of positions where this set-up's argmax equals the token in
    `outputs` (another set-up's greedy outputs for QUESTIONS), given the same
    prefix: all prompts + outputs in one ragged prefill. Unlike whole-output
    agreement, one early flip does not decide a prompt's score."""
    prompts = [chat_ids(tok, q) for q in QUESTIONS[: len(outputs)]]
    logits = sequence_logits(
        model, [p + list(o) for p, o in zip(prompts, outputs)], kv_dtype=kv_dtype
    )
    hits = total = 0
    for lg, prompt, out in zip(logits, prompts, outputs):
        pred = lg[len(prompt) - 1 : len(prompt) - 1 + len(out)].argmax(-1)
        hits += int((pred == np.asarray(out)).sum())
        total += len(out)
    return hits / total
