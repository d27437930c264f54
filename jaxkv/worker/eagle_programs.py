"""The jitted programs of an EAGLE-3 head in the engine
(`jaxkv.core.spec.eagle.EagleProposer` plans their calls):

    follow(params, embed, cache, batch, feats, next_ids, rows)      after a target step
    follow_loop(..., feats [K, T0, 3 Et], src, next_ids, rows)      after a decode loop
    propose(params, embed, cache, batch, first, hidden, index)      k proposals

`follow` runs the head over a target step's rows (row p reads the
target's features at p and the token at p + 1) into its one-layer paged
cache, and returns each sequence's first proposal and hidden state at its
last accepted row; `propose` chains k - 1 more head steps from there.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.model import eagle as head_ops


def follow(
    params, embed, cache, batch, feats, next_ids, rows, *, cfg, attention, all_decode, width
):
    """The head over a target step's rows; at rows [S] (each sequence's last
    accepted row) its first proposal and hidden state, padded to `width`."""
    pre, cache = head_ops.paged_call(
        cfg,
        params,
        embed,
        cache,
        batch,
        attention,
        next_ids,
        feats,
        fuse=True,
        all_decode=all_decode,
    )
    h = pre[rows]  # [S, E]
    tok = head_ops.to_target(params, jnp.argmax(head_ops.draft_logits(cfg, params, h), -1))
    S = rows.shape[0]
    first = jnp.zeros(width, jnp.int32).at[:S].set(tok.astype(jnp.int32))
    hidden = jnp.zeros((width, h.shape[-1]), h.dtype).at[:S].set(h)
    return cache, first, hidden


def follow_loop(params, embed, cache, batch, feats, src, next_ids, rows, **kw):
    """`_follow` over the rows of a decode loop's calls: feats [K, T0, 3 Et]
    (call by call), src [T] each head row's place in them."""
    flat = feats.reshape(-1, feats.shape[-1])[src]
    return follow(params, embed, cache, batch, flat, next_ids, rows, **kw)


def propose(params, embed, cache, batch, first, hidden, index, *, cfg, attention, k, page_size):
    """k proposals [k, S] for the sequences of a one-row-each batch: the
    first from `follow` (by `index` into its outputs), then k - 1 head
    steps at positions after each sequence's newest token."""
    S = batch.kv_lens.shape[0]
    live = jnp.arange(S) < batch.num_seqs
    i = jnp.maximum(index, 0)
    tok, h = first[i], hidden[i]
    out = [tok]
    b = batch
    for _ in range(k - 1):
        pre, cache = head_ops.paged_call(
            cfg, params, embed, cache, b, attention, tok, h, fuse=False, all_decode=True
        )
        tok = head_ops.to_target(
            params, jnp.argmax(head_ops.draft_logits(cfg, params, pre), -1)
        ).astype(jnp.int32)
        h = pre
        out.append(tok)
        pos = b.positions + 1
        page = jnp.take_along_axis(b.block_tables, (pos // page_size)[:, None], axis=1)[:, 0]
        b = dataclasses.replace(
            b,
            positions=pos,
            slot_mapping=jnp.where(live, page * page_size + pos % page_size, 0),
            kv_lens=jnp.where(live, b.kv_lens + 1, 0),
        )
    return cache, jnp.stack(out)
