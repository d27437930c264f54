"""Checks a request before it is queued: the prompt's form and token ids,
the sampling parameters, and whether it fits the model. Each failure is a
ValueError whose message starts with the field at fault."""

from __future__ import annotations

import numpy as np

from jaxkv.core.sampling_params import SamplingParams
from jaxkv.reprs import short


def parse_prompt(prompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """A string, a list of token ids, or {"prompt": str} /
    {"prompt_token_ids": [...]} -> (text or None, token ids)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
            if not isinstance(prompt, (list, tuple, np.ndarray)):
                raise ValueError(
                    f"prompt_token_ids: must be a list of integers, got {short(prompt)}"
                )
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: empty prompt")
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"prompt: not valid Unicode text (a lone surrogate at position {e.start})"
            ) from None
        ids = tokenizer.encode(prompt)
        if not len(ids):  # e.g. only spaces, with a tokenizer that adds no BOS
            raise ValueError(f"prompt: {short(prompt[:40])} is no token at all for this tokenizer")
        return prompt, ids
    if isinstance(prompt, np.ndarray) and prompt.ndim != 1:
        raise ValueError(
            f"prompt_token_ids: must be one list of integers, got shape {prompt.shape}"
        )
    if isinstance(prompt, (list, tuple, np.ndarray)):
        ids = (
            [int(t) for t in prompt]
            if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompt)
            else None
        )
        if ids is None:
            raise ValueError("prompt_token_ids: must be a list of integers")
        if not ids:
            raise ValueError("prompt_token_ids: empty prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: unknown token id {bad[0]} (vocab size {vocab_size})"
            )
        return None, ids
    raise ValueError(f"prompt: expected str, token ids or dict, got {type(prompt).__name__}")


def check_request(
    ids: list[int],
    params,
    *,
    vocab_size: int,
    max_model_len: int,
    has_tokenizer: bool,
    max_prefill: int | None = None,
) -> None:
    """Raise ValueError naming the first thing wrong with running `params`
    on a prompt of `ids`. `max_prefill`: the most tokens one step computes
    when prompts are not chunked."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params: expected SamplingParams, got {type(params).__name__}")
    params.validate(vocab_size)
    if params.stop_list and not has_tokenizer:
        raise ValueError("stop: stop strings need a tokenizer; this model has none")
    if len(ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed "
            f"the maximum model length {max_model_len}"
        )
    if max_prefill is not None and len(ids) + params.max_tokens - 1 > max_prefill:
        # Without chunked prefill a prompt runs in one step; after a
        # preemption, so does the prompt with every token generated so far.
        raise ValueError(
            f"prompt: {len(ids)} prompt tokens + max_tokens {params.max_tokens} do not fit one "
            f"step of max_num_batched_tokens {max_prefill} (enable_chunked_prefill is off)"
        )


def child_seed(seed: int, index: int) -> int:
    """The seed of sequence `index` of an n > 1 request whose seed is `seed`
    (sequence 0 keeps it, so n = 1 draws what it always drew)."""
    return seed if index == 0 else (seed + index * 0x9E3779B9) & 0x7FFFFFFF
