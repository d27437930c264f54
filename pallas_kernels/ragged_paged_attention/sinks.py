"""Learned attention sinks (gpt-oss): one logit per query head, sinks [H],
that joins every row's softmax denominator and carries no value. For query
row i of head h with visible scores s_ij (scaled, soft-capped, masked):

    out_i = sum_j exp(s_ij - m) v_j / (exp(sinks[h] - m) + sum_j exp(s_ij - m)),
    m = max(sinks[h], max_j s_ij)

which is Hugging Face's GptOss eager attention: the sink logit, neither
scaled by sm_scale nor soft-capped, is concatenated to the scores as one
more column before the softmax, and that column is dropped after it. A row
that sees no key, or whose scores all lie far below its sink, gives ~0.

An online softmax takes the sink by starting from it (`softmax_start`):
m = sink and l = exp(sink - m) = 1 before the first key, so the running
rescaling carries it like any other column. Without sinks every kernel
starts from `NO_SINK` (-inf): exp(-inf) = 0 in the denominator, which is
the usual start (m = the kernel's mask value, l = 0), bit for bit.

Kernels keep one softmax state per row of a KV head's tile; `sink_rows`
lays the sinks out that way.
"""

from __future__ import annotations

import jax.numpy as jnp

NO_SINK = float("-inf")  # the sink logit of "no sink": nothing joins the denominator


def softmax_start(sink, mask_value):
    """(m, l): the running max and sum an online softmax starts from so that
    `sink` (any shape, float32) is in its denominator. m = max(sink,
    mask_value) stays finite, so the rescaling exp(m - m_new) of a row that
    has seen nothing yet is never exp(-inf - -inf) = NaN; l = exp(sink - m):
    1 for a finite sink, 0 for NO_SINK."""
    m = jnp.maximum(sink, mask_value)
    return m, jnp.exp(sink - m)


def head_sinks(sinks, num_kv_heads, group):
    """sinks [H] or None -> [KVH, G] float32, query head h at [h // G, h % G]
    (the GQA grouping); NO_SINK everywhere without sinks."""
    if sinks is None:
        return jnp.full((num_kv_heads, group), NO_SINK, jnp.float32)
    return jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group)


def sink_rows(sinks, num_kv_heads, group, group_pad, tokens):
    """The sink of every row of a KV head's tile, rows ordered (token, query
    head of that KV head) token major with the G heads padded to
    `group_pad`: sinks [H] or None -> [KVH, tokens * group_pad] float32. Pad
    heads' rows (never written back) get NO_SINK."""
    per_head = jnp.pad(
        head_sinks(sinks, num_kv_heads, group),
        ((0, 0), (0, group_pad - group)),
        constant_values=NO_SINK,
    )
    return jnp.tile(per_head, (1, tokens))
