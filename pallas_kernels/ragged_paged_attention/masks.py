"""Which keys a query sees, written once for the jnp paths (the reference's
blocked and decode attention, the dense prefill blocks): a key at position
k is seen by a query at position q when k <= q (causal) and, with a
sliding window W, k > q - W or k is one of the first `num_sink_tokens`
(StreamingLLM's sink tokens; learned sink logits are `sinks.py`'s). Every
function broadcasts its position arrays."""

from __future__ import annotations


def in_window(key_pos, query_pos, sliding_window, num_sink_tokens):
    """Keys inside the window of a query at `query_pos`, or sinks; all of
    them (True) without a window."""
    if sliding_window is None:
        return True
    return (key_pos > query_pos - sliding_window) | (key_pos < num_sink_tokens)


def visible(key_pos, query_pos, sliding_window, num_sink_tokens):
    """Keys a query at `query_pos` attends to: causal and in its window."""
    return (key_pos <= query_pos) & in_window(key_pos, query_pos, sliding_window, num_sink_tokens)
