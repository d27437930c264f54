"""Ragged paged attention as a Pallas Mosaic TPU kernel.

Same contract and numbers as `reference.py` (see its module docstring):
q [T, H, D], k_pages / v_pages [KVH, P, page_size, D] (int4: D // 2 bytes)
-> [T, H, D]. It reads every page format of `kv_formats`: float, int8, int4
and fp8 (`tpu_formats.py` turns each into values in VMEM).

Design
------
The kernel body is `tpu_kernel.py`. Grid ``(KVH, T_pad // block_q)``: one cell owns one KV head and one aligned
block of ``block_q`` query tokens, for *all* G = H // KVH query heads of that
KV head (GQA without copying K/V). The wrapper lays q out as
``[KVH, T_pad * G, D]`` (rows ordered token-major, head-minor), so a cell's
queries are one ``[block_q * G, D]`` VMEM tile and a decode row block is G
useful rows of the MXU instead of one.

A query block may hold rows of several sequences (ragged batch: many decodes
share a block, a prefill chunk may span several blocks). The cell walks those
sequences in order; for each it streams only the KV blocks its rows can see
(causal end, sliding-window start) through VMEM. The online-softmax state
(m, l, acc) is per row, and rows of other sequences are masked to probability
zero, so one state tile serves every sequence of the block and the output tile
is written exactly once. Rows of no sequence end with acc = 0 and come out as
0. Learned sinks (`sinks.py`) start each row's state at its head's sink logit
(m = sink, l = 1): the wrapper lays them out per row of a KV head's tile,
[KVH, block_q * G, 128] lane-replicated, one VMEM block per KV head.

Memory:
  SMEM (scalar prefetch): kv_lens [S], block_tables flattened [S * pages_per_seq],
    cu_q_lens [S + 1], num_seqs [1], first_seq [T_pad // block_q] (the first
    sequence whose rows reach each query block).
  HBM (memory_space ANY): k_pages, v_pages, k_scale, v_scale; pages are copied
    one DMA per page into
  VMEM: the sink rows [block_q * G, 128] f32 (BlockSpec, fetched again only
    when the KV head changes), k/v buffers [2, pages_per_block, page_size, D]
    in the pages' dtype (int4: uint8 [.., D // 2]; double buffered: the next
    KV block, possibly the next sequence's first, is in flight while the
    current one is computed), scale buffers [2, pages_per_block, page_size] f32,
    m / l [block_q * G, 128] f32 (lane-replicated), acc [block_q * G, D] f32, and
    the q / out tiles managed by the BlockSpec pipeline.

No cell depends on another (no state crosses grid steps), so both grid axes
are "parallel" and megacore chips may split them.

Numerics: scores in float32 (matmul accumulates in f32, f32 inputs use
HIGHEST precision), masked entries contribute exactly zero (never 0 * NaN, so
unwritten page slots may hold anything). Pages move HBM -> VMEM at their
stored size and become values of the query dtype in VMEM, a KV block at a
time: int8 and fp8 (float8_e4m3fn, float8_e5m2) by conversion, int4 as its
two nibbles - 7.5, unpacked in int32 and joined into [tokens, D] (exact in
bfloat16). int8 and int4 per-token scales are applied to the score /
probability columns (s * k_scale, p * v_scale), which equals dequantizing K
and V. int4's bfloat16 scales are converted to float32 by the wrapper (one
XLA convert of the [KVH, P, page_size] arrays per call): Mosaic cannot DMA
one page's bfloat16 scale row out of their (8, 128)(2, 1) tiling. fp8 pages
are read as their values; their per-head scale is the caller's (folded into
q and the output, `kv_formats`).

Constraints (checked with ValueError): page_size % 8 == 0; D % 64 == 0;
block_q * G % 16 == 0 (default block_q 16 always fits); q float32 or
bfloat16; pages in q's dtype, int8 (float32 scales), int4 (uint8
[.., D // 2], bfloat16 scales) or fp8 (no scales); every format compiles
deviceless for v5e and v6e. ``block_tables`` is copied to SMEM, so
S * pages_per_seq int32 must fit there (keep it well under 1 MiB, i.e.
< ~200K entries with the other tables). VMEM use is about
4 * pages_per_block * page_size * D * itemsize (K/V double buffers; int4:
D // 2 bytes) plus (block_q * G) * (D + 512) * 4 bytes (m, l and the sink
rows' two buffers); the default 256-token KV block stays far below the default scoped-VMEM limit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.checks import check_inputs
from pallas_kernels.ragged_paged_attention.sinks import sink_rows
from pallas_kernels.ragged_paged_attention.tpu_kernel import LANES, rpa_kernel


def _rpa_pallas_call(
    q_t,
    sinks_t,
    k_pages,
    v_pages,
    k_scale,
    v_scale,
    kv_lens,
    block_tables_flat,
    cu_q_lens,
    num_seqs,
    first_seq,
    *,
    group,
    pages_per_seq,
    block_q,
    pages_per_block,
    sm_scale,
    sliding_window,
    soft_cap,
    vmem_limit_bytes,
    interpret,
):
    """q_t [KVH, T_pad * G, D], sinks_t [KVH, block_q * G, 128] f32 -> [KVH,
    T_pad * G, D]."""
    kvh, total_rows, head_dim = q_t.shape
    _, _, page_size, page_dim = k_pages.shape  # page_dim: D, or int4's D // 2 bytes
    rows = block_q * group
    num_q_blocks = total_rows // rows
    quantized = k_scale is not None

    q_spec = pl.BlockSpec((None, rows, head_dim), lambda h, i, *_: (h, i, 0))
    sink_spec = pl.BlockSpec((None, rows, LANES), lambda h, i, *_: (h, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    kv_buf = pltpu.VMEM((2, pages_per_block, page_size, page_dim), k_pages.dtype)
    scale_buf = pltpu.VMEM((2, pages_per_block, page_size), jnp.float32) if quantized else None
    stat = pltpu.VMEM((rows, LANES), jnp.float32)
    kernel = functools.partial(
        rpa_kernel,
        block_q=block_q,
        group=group,
        pages_per_seq=pages_per_seq,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    if not quantized:
        kernel = _with_none_args(kernel)
    scalars = (kv_lens, block_tables_flat, cu_q_lens, num_seqs, first_seq)
    operands = (q_t, sinks_t, k_pages, v_pages) + ((k_scale, v_scale) if quantized else ())
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(kvh, num_q_blocks),
            in_specs=[q_spec, sink_spec, hbm, hbm] + ([hbm, hbm] if quantized else []),
            out_specs=q_spec,
            scratch_shapes=[kv_buf, kv_buf]
            + ([scale_buf, scale_buf] if quantized else [])
            + [
                pltpu.SemaphoreType.DMA((2, 4)),
                stat,
                stat,
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel"), vmem_limit_bytes=vmem_limit_bytes
        ),
        out_shape=jax.ShapeDtypeStruct(q_t.shape, q_t.dtype),
        interpret=interpret,
        name="jaxkv_ragged_paged_attention",
    )(*scalars, *operands)


def _with_none_args(kernel):
    """Adapts the kernel to a call without scale operands / scratch."""

    def wrapped(kv_lens, bt, cu, ns, fs, q, sink, k, v, o, k_buf, v_buf, sems, m, l, acc):
        return kernel(
            kv_lens,
            bt,
            cu,
            ns,
            fs,
            q,
            sink,
            k,
            v,
            None,
            None,
            o,
            k_buf,
            v_buf,
            None,
            None,
            sems,
            m,
            l,
            acc,
        )

    return wrapped


def _default_pages_per_block(page_size, pages_per_seq):
    return max(1, min(pages_per_seq, 256 // page_size))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "block_q",
        "pages_per_block",
        "vmem_limit_bytes",
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
    block_q=16,
    pages_per_block=None,
    vmem_limit_bytes=None,
    interpret=False,
):
    """Ragged paged attention on TPU (contract: `reference.py`).

    q [T, H, D] float32/bfloat16; k_pages, v_pages [KVH, P, page_size, D] in
    q's dtype, int8 with k_scale, v_scale [KVH, P, page_size] float32, int4
    (uint8 [KVH, P, page_size, D // 2]) with bfloat16 scales, or fp8
    (float8_e4m3fn / float8_e5m2) without scales (`kv_formats`);
    kv_lens [S], block_tables [S, pages_per_seq], cu_q_lens [S + 1] int32;
    num_seqs [] or [1] int32; sinks [H] float (learned attention sinks) or
    None -> [T, H, D] in q's dtype.

    Static: sm_scale, sliding_window, soft_cap; tuning: block_q (query tokens per
    grid cell; block_q * G rows must be a multiple of 16), pages_per_block (pages
    per KV block; default 256 tokens' worth), vmem_limit_bytes; interpret (False,
    True or a `pltpu.InterpretParams`) runs the kernel on CPU with TPU semantics.
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
        q_dtypes=(jnp.float32, jnp.bfloat16),
        kernel="TPU",
        sinks=sinks,
    )
    if D % 64:
        raise ValueError(f"TPU kernel needs head dim a multiple of 64, got {D}")
    if page_size % 8:
        raise ValueError(f"TPU kernel needs page_size a multiple of 8, got {page_size}")
    G = H // KVH
    if (block_q * G) % 16:
        raise ValueError(f"block_q * (H // KVH) = {block_q * G} must be a multiple of 16")
    pages_per_seq = block_tables.shape[1]
    if pages_per_block is None:
        pages_per_block = _default_pages_per_block(page_size, pages_per_seq)
    if not 0 < pages_per_block:
        raise ValueError(f"pages_per_block must be positive, got {pages_per_block}")
    if interpret is True:
        interpret = pltpu.InterpretParams()

    num_q_blocks = pl.cdiv(T, block_q)
    T_pad = num_q_blocks * block_q
    num_seqs = jnp.minimum(jnp.reshape(num_seqs, (1,)).astype(jnp.int32), S)
    # Layout: [KVH, T_pad * G, D], rows token-major so a q block is one tile.
    q_t = jnp.pad(q, ((0, T_pad - T), (0, 0), (0, 0)))
    q_t = q_t.reshape(T_pad, KVH, G, D).transpose(1, 0, 2, 3).reshape(KVH, T_pad * G, D)
    live_ends = jnp.where(jnp.arange(S) < num_seqs[0], cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    first_seq = jnp.searchsorted(
        live_ends, jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q, side="right"
    ).astype(jnp.int32)
    # Row r of a KV head's tile is query head r % G of that KV head.
    sinks_t = jnp.broadcast_to(
        sink_rows(sinks, KVH, G, G, block_q)[..., None], (KVH, block_q * G, LANES)
    )
    # Scales in float32 (int4's are bfloat16, which Mosaic cannot DMA a page row of).
    out = _rpa_pallas_call(
        q_t,
        sinks_t,
        k_pages,
        v_pages,
        None if k_scale is None else k_scale.astype(jnp.float32),
        None if v_scale is None else v_scale.astype(jnp.float32),
        kv_lens,
        block_tables.reshape(-1),
        cu_q_lens,
        num_seqs,
        first_seq,
        group=G,
        pages_per_seq=pages_per_seq,
        block_q=block_q,
        pages_per_block=pages_per_block,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        vmem_limit_bytes=vmem_limit_bytes,
        interpret=interpret,
    )
    out = out.reshape(KVH, T_pad, G, D).transpose(1, 0, 2, 3).reshape(T_pad, H, D)
    return out[:T]
