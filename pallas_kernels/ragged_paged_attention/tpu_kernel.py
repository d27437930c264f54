"""The body of the TPU kernel (`tpu.py` has the design, the `pallas_call`
and the public entry), read top-down: the kernel, then its named steps.

One grid cell owns one KV head and one block of query tokens (all G query
heads of that KV head). It walks the sequences whose rows fall in the block;
for each it streams the KV blocks those rows can see through two VMEM slots
(`_Cell.fetch`: page DMAs, the next block in flight while one is used), folds
each block into the per-row online-softmax state (`_Cell.attend`), and
finally writes the normalized output tile once (`_write_back`). Learned
sinks (`sinks.py`) are the state's start: m = sink, l = exp(sink - m).
Pages of every format arrive as stored and become values in VMEM
(`tpu_formats.py`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.sinks import softmax_start
from pallas_kernels.ragged_paged_attention.tpu_formats import page_values, scale_row

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
LANES = 128


def rpa_kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [S]
    block_tables_ref,  # [S * pages_per_seq]
    cu_q_lens_ref,  # [S + 1]
    num_seqs_ref,  # [1]
    first_seq_ref,  # [num_q_blocks]
    # inputs
    q_ref,  # [R, D] VMEM, R = block_q * G
    sink_ref,  # [R, 128] f32 VMEM: each row's sink logit, lane-replicated (-inf: none)
    k_hbm,  # [KVH, P, page_size, D] HBM (int4: uint8 [.., D // 2]; `tpu_formats`)
    v_hbm,
    k_scale_hbm,  # [KVH, P, page_size] f32 HBM (int8, int4), or None
    v_scale_hbm,
    # output
    o_ref,  # [R, D]
    # scratch
    k_buf,  # [2, pages_per_block, page_size, D] in the pages' dtype (int4: D // 2)
    v_buf,
    ks_buf,  # [2, pages_per_block, page_size] f32, or None
    vs_buf,
    sems,  # DMA [2 slots, 4 (k, v, k_scale, v_scale)]
    m_ref,  # [R, 128] f32
    l_ref,  # [R, 128] f32
    acc_ref,  # [R, D] f32
    *,
    block_q: int,
    group: int,
    pages_per_seq: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    cell = _Cell(
        kv_lens_ref,
        block_tables_ref,
        cu_q_lens_ref,
        q_ref,
        k_hbm,
        v_hbm,
        k_scale_hbm,
        v_scale_hbm,
        k_buf,
        v_buf,
        ks_buf,
        vs_buf,
        sems,
        m_ref,
        l_ref,
        acc_ref,
        h=pl.program_id(0),
        blk_start=pl.program_id(1) * block_q,
        block_q=block_q,
        group=group,
        pages_per_seq=pages_per_seq,
        num_seqs=num_seqs_ref[0],
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    m_ref[...], l_ref[...] = softmax_start(sink_ref[...], MASK_VALUE)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def seq_body(carry):
        s, slot = carry
        _, _, _, _, kb_lo, kb_hi = cell.span(s)
        s_next = cell.next_with_work(s + 1)
        has_next_seq = cell.in_block(s_next)

        def kv_body(kb, slot):
            # Prefetch the next KV block: this sequence's, or the next one's first.
            last = kb + 1 == kb_hi
            fetch_s = jnp.where(last, jnp.minimum(s_next, cell.num_seqs - 1), s)
            fetch_kb = jnp.where(last, cell.span(fetch_s)[4], kb + 1)

            @pl.when(jnp.logical_or(jnp.logical_not(last), has_next_seq))
            def _():
                cell.fetch(fetch_s, fetch_kb, 1 - slot, "start")

            cell.fetch(s, kb, slot, "wait")
            cell.attend(s, kb, slot)
            return 1 - slot

        return s_next, lax.fori_loop(kb_lo, kb_hi, kv_body, slot)

    s0 = cell.next_with_work(first_seq_ref[pl.program_id(1)])

    @pl.when(cell.in_block(s0))
    def _():
        cell.fetch(s0, cell.span(s0)[4], 0, "start")

    lax.while_loop(lambda c: cell.in_block(c[0]), seq_body, (s0, 0))
    _write_back(o_ref, l_ref, acc_ref)


def _write_back(o_ref, l_ref, acc_ref):
    """Normalize the accumulated rows and store the output tile; rows of no
    sequence (acc = 0; l = 0 without a sink) come out as 0."""
    l = l_ref[...]
    inv = jnp.where(l > 0.0, 1.0 / jnp.where(l > 0.0, l, 1.0), 0.0)
    o_ref[...] = (acc_ref[...] * lane_bcast(inv, o_ref.shape[1])).astype(o_ref.dtype)


@dataclasses.dataclass
class _Cell:
    """The refs and static parameters of one grid cell, and its steps."""

    kv_lens_ref: object
    block_tables_ref: object
    cu_q_lens_ref: object
    q_ref: object
    k_hbm: object
    v_hbm: object
    k_scale_hbm: object
    v_scale_hbm: object
    k_buf: object
    v_buf: object
    ks_buf: object
    vs_buf: object
    sems: object
    m_ref: object
    l_ref: object
    acc_ref: object
    h: object
    blk_start: object
    block_q: int
    group: int
    pages_per_seq: int
    num_seqs: object
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None

    @property
    def block_kv(self) -> int:
        return self.k_buf.shape[1] * self.k_buf.shape[2]

    def in_block(self, s):
        """Whether sequence s is live and has rows before this block's end."""
        blk_end = self.blk_start + self.block_q
        return jnp.logical_and(
            s < self.num_seqs, self.cu_q_lens_ref[jnp.minimum(s, self.num_seqs)] < blk_end
        )

    def span(self, s):
        """Token rows [t0, t1) of sequence s inside this block, the position of
        its first row, one past its last row's position, and its KV block
        range [kb_lo, kb_hi) (empty if no rows)."""
        q_start, q_end = self.cu_q_lens_ref[s], self.cu_q_lens_ref[s + 1]
        t0 = jnp.maximum(q_start, self.blk_start)
        t1 = jnp.minimum(q_end, self.blk_start + self.block_q)
        pos0 = self.kv_lens_ref[s] - (q_end - q_start) + (t0 - q_start)
        kv_hi = pos0 + (t1 - t0)
        kv_lo = 0 if self.sliding_window is None else jnp.maximum(pos0 - self.sliding_window + 1, 0)
        kb_lo = kv_lo // self.block_kv
        kb_hi = jnp.where(t1 > t0, pl.cdiv(kv_hi, self.block_kv), kb_lo)
        return t0, t1, pos0, kv_hi, kb_lo, kb_hi

    def next_with_work(self, s):
        """The first sequence from s on that has KV blocks to read here."""

        def cond(s):
            _, _, _, _, kb_lo, kb_hi = self.span(jnp.clip(s, 0, jnp.maximum(self.num_seqs - 1, 0)))
            return jnp.logical_and(self.in_block(s), kb_hi <= kb_lo)

        return lax.while_loop(cond, lambda s: s + 1, s)

    def fetch(self, s, kb, slot, what: str):
        """Start ("start") or wait for ("wait") the page DMAs of KV block kb of
        sequence s into VMEM slot `slot`: only pages holding keys some row of
        this block may see are copied."""
        _, _, _, kv_hi, _, _ = self.span(s)
        n_pages = pl.cdiv(kv_hi, self.k_buf.shape[2])
        quantized = self.ks_buf is not None
        for j in range(self.k_buf.shape[1]):
            p = kb * self.k_buf.shape[1] + j
            last = self.pages_per_seq - 1
            page = self.block_tables_ref[s * self.pages_per_seq + jnp.minimum(p, last)]
            copies = [
                pltpu.make_async_copy(
                    self.k_hbm.at[self.h, page], self.k_buf.at[slot, j], self.sems.at[slot, 0]
                ),
                pltpu.make_async_copy(
                    self.v_hbm.at[self.h, page], self.v_buf.at[slot, j], self.sems.at[slot, 1]
                ),
            ]
            if quantized:
                copies += [
                    pltpu.make_async_copy(
                        self.k_scale_hbm.at[self.h, pl.ds(page, 1)],
                        self.ks_buf.at[slot, pl.ds(j, 1)],
                        self.sems.at[slot, 2],
                    ),
                    pltpu.make_async_copy(
                        self.v_scale_hbm.at[self.h, pl.ds(page, 1)],
                        self.vs_buf.at[slot, pl.ds(j, 1)],
                        self.sems.at[slot, 3],
                    ),
                ]
            for cp in copies:
                pl.when(p < n_pages)(cp.start if what == "start" else cp.wait)

    def attend(self, s, kb, slot):
        """One online-softmax step: rows of sequence s against KV block kb."""
        t0, t1, pos0, _, _, _ = self.span(s)
        rows, head_dim = self.q_ref.shape
        page_size, block_kv = self.k_buf.shape[2], self.block_kv
        compute_dtype = self.q_ref.dtype
        row_tok = (
            self.blk_start + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 0) // self.group
        )
        key = kb * block_kv + lax.broadcasted_iota(jnp.int32, (rows, block_kv), 1)
        q_pos = pos0 + (row_tok - t0)
        mask = (row_tok >= t0) & (row_tok < t1) & (key <= q_pos)
        if self.sliding_window is not None:
            mask = mask & (key > q_pos - self.sliding_window)

        k = page_values(self.k_buf[slot], compute_dtype)  # [block_kv, D]
        v = page_values(self.v_buf[slot], compute_dtype)
        # Keys past the causal end were never copied (stale VMEM) or are unwritten
        # slots: zero them so 0-probability * garbage stays 0.
        v_live = kb * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0) < pos0 + (
            t1 - t0
        )
        v = jnp.where(v_live, v, jnp.zeros_like(v))
        precision = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

        s_ = (
            lax.dot_general(
                self.q_ref[...],
                k,
                (((1,), (1,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            * self.sm_scale
        )  # [R, block_kv]
        quantized = self.ks_buf is not None
        if quantized:
            pages_per_block = self.k_buf.shape[1]
            slot_key = (
                kb * block_kv
                + page_size * lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 0)
                + lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 1)
            )
            scale_live = slot_key < pos0 + (t1 - t0)
            s_ = s_ * scale_row(self.ks_buf[slot], scale_live)
        if self.soft_cap is not None:
            s_ = self.soft_cap * jnp.tanh(s_ / self.soft_cap)
        s_ = jnp.where(mask, s_, MASK_VALUE)

        m_prev = self.m_ref[...]  # [R, 128]
        m_next = jnp.maximum(m_prev, jnp.max(s_, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(mask, jnp.exp(s_ - m_next[:, :1]), 0.0)
        self.l_ref[...] = alpha * self.l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        self.m_ref[...] = m_next
        if quantized:
            p = p * scale_row(self.vs_buf[slot], scale_live)
        pv = jnp.dot(
            p.astype(compute_dtype), v, precision=precision, preferred_element_type=jnp.float32
        )  # [R, D]
        self.acc_ref[...] = lane_bcast(alpha, head_dim) * self.acc_ref[...] + pv


def lane_bcast(x, n):
    """[R, 128] lane-replicated row statistic -> [R, n]."""
    if n == LANES:
        return x
    if n < LANES:
        return x[:, :n]
    return jnp.tile(x, (1, n // LANES))
