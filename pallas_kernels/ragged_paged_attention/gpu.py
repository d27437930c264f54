"""Ragged paged attention as a Pallas GPU (Triton) kernel.

Same contract and numbers as `reference.py` (see its module docstring):
q [T, H, D], k_pages / v_pages [KVH, P, page_size, D] -> [T, H, D], in
every KV page format of `kv_formats.py` (float, int8, int4, fp8).

Why Triton is the GPU default
-----------------------------
Pallas has two GPU backends. Mosaic GPU is where upstream is heading (JAX
deprecated the Triton backend in 0.11), and `mosaic_gpu.py` is this kernel's
Hopper version (TMA, wgmma; bfloat16 / float16 only). But that one has only
run in jax's Mosaic GPU interpret mode and been lowered for CUDA, never on a
GPU, so this Triton kernel stays the default: it lowers the same text for
any CUDA GPU from Ampere on (H100 / H200 included), does page gathers as
plain masked pointer loads, pipelines them with `num_stages`, takes float32,
int8, int4 and fp8 pages, and its Pallas surface (`pl.pallas_call`,
`plgpu.load/store`, `plgpu.CompilerParams`) is unchanged in jax 0.10.2 and 0.11.2. Decode
attention is memory bound, so Triton's lack of TMA / wgmma costs little
there; prefill throughput is where the Mosaic GPU kernel should pay.

Design
------
The kernel body is `gpu_kernel.py`. Queries are cut into work blocks of `block_q` tokens that never span two
sequences (at most cdiv(T, block_q) + S of them, built on device from
cu_q_lens). Grid ``(num_blocks, KVH, num_splits)``: a program owns one block,
one KV head, all G query heads of that KV head (rows = block_q x G_pad, token
major; GQA without copying K/V), and one split of the block's visible context
(causal end, sliding-window start), in KV blocks of `pages_per_block` pages
gathered through the block table. Online softmax (flash) over those KV
blocks; with num_splits > 1 (flash decoding: few queries, long context) every
split writes its normalized partial output and log-sum-exp and the splits are
merged by LSE weights afterwards.

Learned sinks (`sinks.py`): without splits each row's online softmax starts
from its head's sink logit (m = sink, l = 1); with splits the kernel runs
without them and the sink joins the merge as one more split with output 0
and log-sum-exp = sink, so it is counted once, not once per split.

Two configurations are compiled and `lax.cond` picks one at run time, as the
reference does: a decode batch (every q_len <= 1) runs block_q = 1 with
context splits; a batch with prefill chunks runs block_q = 16 without splits.

Numerics: float32 accumulation; f32 inputs use IEEE (not TF32) dots; masked
scores contribute exactly zero and unwritten page slots are zeroed before the
PV product, so NaN in unused slots never leaks. Pages are loaded at their
stored size and turned into values of the query dtype in registers: int8 by
a cast, fp8 (float8_e4m3fn, float8_e5m2) by Triton's native conversion
(e4m3fn needs sm_89 or later: Ada, Hopper), int4 bytes by two masks / shifts
into their low-nibble half (channels [0, D/2)) and high-nibble half ([D/2,
D)), nibble - 7.5 (exact in bfloat16 / float16). An int4 block is computed
as two half-width products: scores = q[:, :D/2] K_lo^T + q[:, D/2:] K_hi^T,
and the output accumulates in the two halves (no lane shuffles). The
per-token scales of int8 (float32) and int4 (bfloat16, widened in registers)
multiply score / probability columns, not the pages.

Shape rules (ValueError otherwise): D a power of two >= 16 (int4: >= 32, a
half is a dot operand); page_size a power of two; pages_per_block *
page_size >= 16 and a power of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.checks import check_inputs
from pallas_kernels.ragged_paged_attention.gpu_kernel import rpa_kernel, work_blocks
from pallas_kernels.ragged_paged_attention.kv_formats import page_format
from pallas_kernels.ragged_paged_attention.sinks import NO_SINK, head_sinks, sink_rows


def _rpa_pallas_call(
    q_g,
    sinks_g,
    k_pages,
    v_pages,
    k_scale,
    v_scale,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    group,
    block_q,
    num_splits,
    pages_per_block,
    sm_scale,
    sliding_window,
    soft_cap,
    num_warps,
    num_stages,
    interpret,
):
    """q_g [T + block_q, KVH, G_pad, D], sinks_g [KVH, block_q * G_pad] f32 (each
    row's softmax start) -> (out [splits, T + block_q, KVH, G_pad, D], lse
    [splits, T + block_q, KVH, G_pad] f32 or None when num_splits == 1)."""
    T_pad, KVH = q_g.shape[:2]
    T = T_pad - block_q
    S = kv_lens.shape[0]
    _, P, page_size, width = k_pages.shape  # width: D, or D // 2 bytes for int4
    # Sum over sequences of cdiv(q_len, block_q) is at most this.
    num_blocks = (T + S * (block_q - 1)) // block_q
    blk_seq, blk_row, blk_len = work_blocks(
        cu_q_lens, num_seqs, block_q=block_q, num_blocks=num_blocks
    )
    whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
    per_head = pl.BlockSpec((None, P, page_size, width), lambda b, h, s: (h, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, P, page_size), lambda b, h, s: (h, 0, 0))
    quantized = k_scale is not None
    with_lse = num_splits > 1
    out_shape = [
        jax.ShapeDtypeStruct(
            (num_splits, *q_g.shape), q_g.dtype if num_splits == 1 else jnp.float32
        )
    ]
    out_specs = [pl.BlockSpec((None, *q_g.shape), lambda b, h, s: (s, 0, 0, 0, 0))]
    if with_lse:
        out_shape.append(jax.ShapeDtypeStruct((num_splits, *q_g.shape[:3]), jnp.float32))
        out_specs.append(pl.BlockSpec((None, *q_g.shape[:3]), lambda b, h, s: (s, 0, 0, 0)))
    kernel = functools.partial(
        rpa_kernel,
        block_q=block_q,
        group=group,
        pages_per_block=pages_per_block,
        num_splits=num_splits,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    kernel = _adapt(kernel, quantized=quantized, with_lse=with_lse)
    metadata = (blk_seq, blk_row, blk_len, kv_lens, cu_q_lens, block_tables, sinks_g)
    operands = (q_g, k_pages, v_pages) + ((k_scale, v_scale) if quantized else ())
    outs = pl.pallas_call(
        kernel,
        grid=(num_blocks, KVH, num_splits),
        in_specs=[whole(a) for a in metadata]
        + [whole(q_g), per_head, per_head]
        + ([scale_spec, scale_spec] if quantized else []),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"jaxkv_rpa_bq{block_q}_splits{num_splits}",
    )(*metadata, *operands)
    return outs[0], (outs[1] if with_lse else None)


def _adapt(kernel, *, quantized, with_lse):
    """Fills the optional refs (scales, lse) with None when absent."""

    def wrapped(*refs):
        refs = list(refs)
        if not quantized:
            refs[10:10] = [None, None]
        if not with_lse:
            refs.append(None)
        return kernel(*refs)

    return wrapped


def _next_pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def _attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    k_scale,
    v_scale,
    sinks,
    *,
    block_q,
    num_splits,
    pages_per_block,
    num_warps,
    num_stages,
    sm_scale,
    sliding_window,
    soft_cap,
    interpret,
):
    """One compiled configuration; returns [T, H, D] with padding rows zeroed."""
    T, H, D = q.shape
    KVH = k_pages.shape[0]
    G = H // KVH
    g_pad = max(_next_pow2(G), -(-16 // block_q))  # Triton dots need >= 16 rows
    q_g = q.reshape(T, KVH, G, D)
    q_g = jnp.pad(q_g, ((0, block_q), (0, 0), (0, g_pad - G), (0, 0)))
    # With splits the sink joins the merge below, once.
    sinks_g = sink_rows(sinks if num_splits == 1 else None, KVH, G, g_pad, block_q)
    out, lse = _rpa_pallas_call(
        q_g,
        sinks_g,
        k_pages,
        v_pages,
        k_scale,
        v_scale,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        group=G,
        block_q=block_q,
        num_splits=num_splits,
        pages_per_block=pages_per_block,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    if lse is None:
        out = out[0]
    else:  # merge the flash-decoding splits by log-sum-exp, the sink as one more (output 0)
        sink = jnp.pad(
            head_sinks(sinks, KVH, G), ((0, 0), (0, g_pad - G)), constant_values=NO_SINK
        )  # [KVH, G_pad]
        m = jnp.maximum(jnp.max(lse, axis=0), sink)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - m), 0.0)
        total = jnp.sum(w, axis=0) + jnp.exp(sink - m)  # exp(-inf) = 0: no sink
        out = jnp.sum(out * w[..., None], axis=0) / jnp.maximum(total, 1e-30)[..., None]
    out = out[:T, :, :G].reshape(T, H, D)
    S = kv_lens.shape[0]
    live = jnp.arange(T) < cu_q_lens[jnp.minimum(num_seqs, S)]
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype)


def _default_splits(num_seqs, num_kv_heads, num_kv_blocks, target_programs=264):
    """Flash-decoding splits: enough programs to fill ~2 waves of a 132-SM GPU,
    but never more splits than KV blocks."""
    want = -(-target_programs // max(1, num_seqs * num_kv_heads))
    return max(1, min(want, num_kv_blocks, 64))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "pages_per_block",
        "decode_splits",
        "prefill_block_q",
        "num_warps",
        "num_stages",
        "all_decode",
        "interpret",
    ),
)
def ragged_paged_attention(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sm_scale,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
    k_scale=None,
    v_scale=None,
    pages_per_block=None,
    decode_splits=None,
    prefill_block_q=16,
    num_warps=4,
    num_stages=2,
    all_decode=None,
    interpret=False,
):
    """Ragged paged attention on GPU via Pallas Triton (contract: `reference.py`).

    q [T, H, D] float32/bfloat16/float16; k_pages, v_pages [KVH, P, page_size, D]
    in q's dtype, or float8_e4m3fn / float8_e5m2 (no scales), or int8 with
    k_scale, v_scale [KVH, P, page_size] float32, or int4: uint8 [KVH, P,
    page_size, D // 2] with k_scale, v_scale bfloat16 (`kv_formats.py`);
    kv_lens [S], block_tables [S, pages_per_seq], cu_q_lens [S + 1] int32;
    num_seqs [] or [1] int32; sinks [H] float (learned attention sinks) or
    None -> [T, H, D] in q's dtype.

    Static: sm_scale, sliding_window, soft_cap; tuning: pages_per_block (KV
    tokens per step = pages_per_block * page_size, default 64 tokens),
    decode_splits (context splits for decode batches; default fills the GPU),
    prefill_block_q (query tokens per program for prefill batches), num_warps,
    num_stages; all_decode (True / False: only the decode / prefill
    configuration is compiled; None: both, picked at run time);
    interpret=True runs on CPU.
    """
    T, H, D, KVH, P, page_size, S = check_inputs(
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        q_dtypes=(jnp.float32, jnp.bfloat16, jnp.float16),
        kernel="GPU",
        sinks=sinks,
    )
    if D < 16 or D & (D - 1):
        raise ValueError(f"GPU kernel needs head dim a power of two >= 16, got {D}")
    if page_format(k_pages) == "int4" and D < 32:
        raise ValueError(
            f"GPU kernel needs head dim >= 32 for int4 pages (each half is a "
            f"dot operand of >= 16), got {D}"
        )
    if page_size & (page_size - 1):
        raise ValueError(f"GPU kernel needs page_size a power of two, got {page_size}")
    if pages_per_block is None:
        pages_per_block = max(1, 64 // page_size)
    block_kv = pages_per_block * page_size
    if block_kv < 16 or block_kv & (block_kv - 1):
        raise ValueError(f"pages_per_block * page_size = {block_kv} must be a power of two >= 16")
    if prefill_block_q < 1 or prefill_block_q & (prefill_block_q - 1):
        raise ValueError(f"prefill_block_q must be a power of two, got {prefill_block_q}")

    pages_per_seq = block_tables.shape[1]
    pad_pages = -pages_per_seq % pages_per_block
    block_tables = jnp.pad(block_tables, ((0, 0), (0, pad_pages)))
    num_kv_blocks = (pages_per_seq + pad_pages) // pages_per_block
    if decode_splits is None:
        decode_splits = _default_splits(S, KVH, num_kv_blocks)
    num_seqs = jnp.minimum(jnp.reshape(num_seqs, ()).astype(jnp.int32), S)
    kw = dict(
        pages_per_block=pages_per_block,
        num_warps=num_warps,
        num_stages=num_stages,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
    )
    args = (
        q,
        k_pages,
        v_pages,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        k_scale,
        v_scale,
        sinks,
    )
    decode = functools.partial(_attention, block_q=1, num_splits=decode_splits, **kw)
    prefill = functools.partial(_attention, block_q=prefill_block_q, num_splits=1, **kw)
    if all_decode is not None:
        return decode(*args) if all_decode else prefill(*args)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    decoding = jnp.all(jnp.where(jnp.arange(S) < num_seqs, q_lens, 0) <= 1)
    return lax.cond(decoding, lambda a: decode(*a), lambda a: prefill(*a), args)
