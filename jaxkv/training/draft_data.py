"""The data `jaxkv train-draft` trains an EAGLE-3 head on: prompts read,
answered greedily by the engine (self-distillation), and one pass of the
target over each prompt + answer recording the features the head reads
and the target's greedy token at every position; the draft vocabulary
chosen from them."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def read_prompts(path: str | os.PathLike) -> list:
    """Prompts of a JSONL file ({"prompt": str} or {"messages": [...]} per
    line); ValueError naming the line of a bad one."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if isinstance(d, dict) and isinstance(d.get("prompt"), str):
                out.append(d["prompt"])
            elif isinstance(d, dict) and isinstance(d.get("messages"), list):
                out.append(d["messages"])
            else:
                raise ValueError(f'{path}:{n}: expected {{"prompt": str}} or {{"messages": [...]}}')
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def answer(
    engine, tokenizer, prompts: Sequence, max_tokens: int
) -> tuple[list[list[int]], list[int]]:
    """Each prompt (chat-templated when the tokenizer has a template) with
    the engine's greedy answer: (token id lists, each prompt's length)."""
    from jaxkv.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = []
    for p in prompts:
        if tokenizer is not None and tokenizer.chat_template:
            msgs = p if isinstance(p, list) else [{"role": "user", "content": p}]
            ids.append(
                tokenizer.encode(
                    tokenizer.apply_chat_template(msgs, add_generation_prompt=True),
                    add_special_tokens=False,
                )
            )
        elif tokenizer is not None:
            ids.append(tokenizer.encode(p if isinstance(p, str) else p[-1]["content"]))
        else:
            ids.append(list(p))
    rid = [engine.add_request({"prompt_token_ids": x}, params) for x in ids]
    done = engine.run_to_completion()
    return (
        [list(x) + list(done[r].outputs[0].token_ids) for x, r in zip(ids, rid)],
        [len(x) for x in ids],
    )


def target_features(
    model,
    sequences: Sequence[Sequence[int]],
    aux_layers,
    length: int,
    group: int = 4,
    page_size: int = 16,
    starts: Sequence[int] | None = None,
) -> dict[str, np.ndarray]:
    """One pass of the target over each sequence (cut or padded to
    `length`): feats [N, length, 3 E] float16 (the inputs of `aux_layers`),
    tokens [N, length], labels [N, length] (the target's greedy token after
    each position), mask [N, length] (real rows), start [N] (where each
    answer starts: the prompt's length; 0 without `starts`)."""
    from flax import nnx

    from jaxkv.config import CacheConfig
    from jaxkv.model.attention import AttentionSpec
    from jaxkv.model.kv_cache import create_cache
    from jaxkv.worker.scoring import scoring_batch

    model.aux_layers = tuple(aux_layers)
    graphdef, state = nnx.split(model)
    attention = AttentionSpec(sliding_window=model.config.uniform_window)
    pages = -(-length // page_size)
    cache = create_cache(
        model.config, CacheConfig(num_pages=group * pages + 1, page_size=page_size)
    )

    @jax.jit
    def run(state, cache, batch):
        logits, cache, feats = nnx.merge(graphdef, state)(
            cache, batch, attention, all_decode=False, features=True
        )
        return jnp.argmax(logits, -1).astype(jnp.int32), feats.astype(jnp.float16), cache

    N = len(sequences)
    E3 = len(aux_layers) * model.config.hidden_size
    out = dict(
        feats=np.zeros((N, length, E3), np.float16),
        tokens=np.zeros((N, length), np.int32),
        labels=np.zeros((N, length), np.int32),
        mask=np.zeros((N, length), bool),
        start=np.asarray(starts if starts is not None else np.zeros(N), np.int32),
    )
    for g in range(0, N, group):
        seqs = []
        for i in range(group):
            s = list(sequences[g + i])[:length] if g + i < N else [0]
            n = len(s)
            if g + i < N:
                out["tokens"][g + i, :n] = s
                out["mask"][g + i, :n] = True
            seqs.append(
                (s + [0] * (length - n), 0, list(range(1 + i * pages, 1 + (i + 1) * pages)))
            )
        batch = scoring_batch(seqs, page_size, rows_per_seq=True)
        labels, feats, cache = run(state, cache, batch)
        labels, feats = np.asarray(labels), np.asarray(feats)
        for i in range(min(group, N - g)):
            out["labels"][g + i] = labels[i * length : (i + 1) * length]
            out["feats"][g + i] = feats[i * length : (i + 1) * length]
    return out


def choose_vocab(
    labels: np.ndarray, mask: np.ndarray, vocab_size: int, size: int, always: Sequence[int] = ()
) -> np.ndarray:
    """The draft vocabulary: the `size` target tokens the target predicts
    most often (and `always`), as d2t [Vd] (draft id d is target id
    d + d2t[d]), target ids ascending."""
    counts = np.bincount(labels[mask], minlength=vocab_size).astype(np.float64)
    counts[list(always)] += np.inf
    size = min(size, vocab_size)
    ids = np.sort(np.argsort(-counts, kind="stable")[:size])
    return (ids - np.arange(size)).astype(np.int32)


def draft_index(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
    """Target id -> draft id, -1 where the draft vocabulary lacks it."""
    t2d = np.full(vocab_size, -1, np.int32)
    t2d[np.arange(len(d2t)) + d2t] = np.arange(len(d2t), dtype=np.int32)
    return t2d


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """The sequence indices of training step `step` (a fixed function of
    the step: a resumed run sees the same batches)."""
    epoch, pos = divmod(step * batch_size, n)
    idx = []
    while len(idx) < batch_size:
        order = np.random.default_rng([seed, epoch]).permutation(n)
        part = order[pos : pos + batch_size - len(idx)]
        idx.extend(part.tolist())
        epoch, pos = epoch + 1, 0
    return np.asarray(idx)


def take(data: dict, idx) -> dict:
    """The sequences `idx` of `data` as one batch on the device."""
    out = {k: jnp.asarray(data[k][idx]) for k in ("feats", "tokens", "labels", "mask")}
    out["start"] = jnp.asarray(
        data["start"][idx] if "start" in data else np.zeros(len(idx), np.int32)
    )
    return out


def per_step_length(lengths: np.ndarray) -> tuple[int, int]:
    """(accepted proposals, drafting steps) of greedy decoding as the
    engine runs it, from each anchor's accepted length (`lengths` [B, T],
    0 where no anchor): a step from anchor t (its features the last the
    target computed, token t + 1 known) gains L = lengths[t] tokens, at
    most those left, and the next step's anchor is t + L; with one token
    left the engine proposes nothing. Long runs are stepped over, so this
    is below the mean over all anchors (the engine's mean accepted length
    is 1 + accepted / drafts)."""
    accepted = drafts = 0
    for row in np.asarray(lengths):
        at = np.flatnonzero(row)
        if not len(at):
            continue
        t, end = int(at[0]), int(at[-1]) + 1  # end: the last token's row
        while end - t - 1 >= 2:
            n = min(int(row[t]), end - t - 1)
            accepted, drafts, t = accepted + n - 1, drafts + 1, t + n
    return accepted, drafts
