"""Speculative decoding on the host: who proposes and what it earned (`decode`: prompt lookup, the gate), a draft model (`draft_model`) and EAGLE-3 heads (`eagle`)."""
