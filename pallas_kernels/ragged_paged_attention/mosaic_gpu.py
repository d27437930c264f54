"""Ragged paged attention as a Pallas Mosaic GPU kernel for Hopper (sm_90a).

Same contract and numbers as `reference.py` (see its module docstring):
q [T, H, D], k_pages / v_pages [KVH, P, page_size, D] -> [T, H, D], in
every KV page format of `kv_formats.py` (float, fp8, int8, int4).

Where it stands
---------------
`gpu.py` (Pallas Triton) stays the GPU path; this kernel is the Hopper
version written against the Mosaic GPU programming model (`plgpu.kernel`:
TMA copies into shared memory, mbarriers, wgmma on the tensor cores). It is
tested on CPU in the Mosaic GPU interpret mode that jax ships from 0.10
(`interpret=True`), and lowered for CUDA without a GPU (the Mosaic GPU
module inside an XLA custom call; turning it into SASS needs a GPU).

Design
------
The kernel body is `mosaic_gpu_kernel.py` (the Pallas API it uses, across
jax versions: `mosaic_gpu_api.py`). Queries are cut into work blocks of
block_q = 64 // G_pad tokens that never span two sequences (G_pad: the
query heads per KV head rounded up to a power of two), so a block of one KV
head is exactly 64 rows, token major: one warpgroup's wgmma tile (GQA
without copying K/V; a decode is one token x G_pad heads in its own block).
The wrapper gathers the blocks' queries into [NB, KVH, 1, 64, D] (and scatters
the output back), so every copy the kernel makes is a whole tile at
integer coordinates (and jax 0.10's interpret mode rejects slices with a
dynamic start: "Dynamic indexing not supported in GPU interpret mode").

Grid (NB, KVH), one warpgroup per program. The program TMA-copies its query
tile, then walks the KV blocks of `block_kv` keys its rows can see (from
the oldest key in the sliding window to the newest query's position), each
gathered by one TMA copy per page through the block table into a shared
memory slot. Two slots: KV block j + 1 is in flight while block j is
computed on. Learned sinks (`sinks.py`): the wrapper lays them out per row
of a KV head's tile, [KVH, 64] float32; the program copies its head's row
into shared memory with the queries and starts each row's online softmax
there (m = sink, l = 1). Per block: S = Q K^T by wgmma (K read through a transposed
view), scale, soft cap, causal / window / length mask, online softmax in
registers (float32), P written to shared memory in the input dtype and
O += P V by wgmma. Value rows outside [window start, kv_len) are zeroed in
shared memory before the product (unwritten slots may hold NaN; only the
first and last KV block of a program can hold such rows).

KV formats: float pages are wgmma's operands as they land. fp8, int8 and
int4 pages are copied at their stored size (1 or 1/2 byte per value) and
dequantized once a block has landed (`_dequantize`): shared memory to
registers, float32 (fp8 through float16: Hopper's cvt, exact), times the
token's scale (int8, int4), rows outside [window start, kv_len) zeroed,
rounded to q's dtype into a shared memory tile that wgmma reads. wgmma has
no bf16 x fp8 product, so fp8 is widened rather than q narrowed. int4's head
dim travels as two column parts (the bytes' low nibbles are channels [0,
D/2), the high ones [D/2, D)): the wrapper lays q out as [.., 2, 64, D/2],
the scores are two wgmmas into one accumulator and the output accumulates
per half, so a packed row is unpacked without moving a lane. The per-token
scales of a sequence are gathered by the wrapper along its block table into
KV block order, [KVH, S, KB, block_kv], one TMA copy per block: a page's
own scales (page_size * 4 or 2 bytes) are below the 128 bytes a Mosaic GPU
copy moves at least.

Costs this version still pays (next steps, once it runs on a GPU): the
wrapper's gather of the queries and scatter of the output; a decode uses
G_pad of its block's 64 rows; no context splits (flash decoding) for few
long decodes; P makes a round trip through shared memory (see interpret
below); one warpgroup per program, without producer / consumer warp
specialization; quantized blocks are dequantized by the same warpgroup
between landing and wgmma (a shared memory round trip, not overlapped with
the products), and their scales' gather writes 4 (int8) or 2 (int4) bytes
per token of every block table entry and KV head, for K and V.

Numerics: float32 accumulation and softmax; P rounded to the input dtype
before the value product, as the Triton kernel does. fp8 values are exact in
bfloat16 / float16; int8 and int4 values times their scale are rounded to
q's dtype (the Triton kernel scales score / probability columns instead).

Limits (ValueError otherwise)
-----------------------------
- q bfloat16 or float16, float pages in q's dtype (or fp8, int8, int4):
  wgmma computes float32 operands as TF32 (about 1e-3 relative error),
  beyond the float32 tolerance the contract holds the other kernels to;
  float32 caches use `gpu.py`.
- head dim 64 or 128 (swizzled tiles of 64 elements, 32 per int4 half).
- page_size a power of two from 8 to block_kv (pages land on whole 8-row
  tiles; a KV block is whole pages); block_kv 64 or 128.
- H / KVH <= 64 (one warpgroup's rows hold at least one token).

interpret: False runs the compiled kernel (a Hopper GPU); True, or a
`jax._src.pallas.mosaic_gpu.interpret.InterpretGPUParams`, the interpret
mode on CPU. jax 0.10's interpret mode has three gaps this kernel works
around; the first two under interpret only, the third on both paths:
wgmma cannot read a transposed shared memory view (`AttributeError:
'TransposeTransform' object has no attribute 'indices'`; the K tile is
transposed through registers into a scratch buffer instead); layout_cast
has no CPU rule (register layouts are left out, they mean nothing there);
wgmma cannot take its A operand from registers (`ValueError: Expected
shape (5,)`; so P goes through shared memory).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import mosaic_gpu_kernel as mk
from pallas_kernels.ragged_paged_attention.checks import check_inputs
from pallas_kernels.ragged_paged_attention.gpu_kernel import work_blocks
from pallas_kernels.ragged_paged_attention.kv_formats import page_format
from pallas_kernels.ragged_paged_attention.mosaic_gpu_api import (
    api,
    interpret_params,
    kernel_call,
    smem,
    swizzle_bytes,
)
from pallas_kernels.ragged_paged_attention.sinks import sink_rows

Q_DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
BLOCK_KVS = (64, 128)


def _rpa_kernel_call(
    meta,
    tables,
    sinks_rows,
    q_blk,
    k_pages,
    v_pages,
    k_scale,
    v_scale,
    *,
    group_pad,
    block_kv,
    sm_scale,
    sliding_window,
    soft_cap,
    interpret,
):
    """q_blk [NB, KVH, n_parts, 64, part], sinks_rows [KVH, 64] f32, k_scale /
    v_scale [KVH, S, KB, block_kv] or None (`_block_scales`) -> out [NB, KVH,
    n_parts, 64, part] (q's dtype)."""
    plgpu = api()
    NB, KVH, n_parts, rows, part = q_blk.shape
    dtype = q_blk.dtype
    page_size, width = k_pages.shape[2:]
    pages_per_block = block_kv // page_size
    params = interpret_params(interpret)
    swizzle = swizzle_bytes(part, dtype)  # wgmma's two operands share one swizzle
    stored = smem(
        (mk.NUM_SLOTS, block_kv, width), k_pages.dtype, swizzle_bytes(width, k_pages.dtype)
    )
    converted = smem((n_parts, block_kv, part), dtype, swizzle)
    scales = None if k_scale is None else plgpu.SMEM((mk.NUM_SLOTS, block_kv), k_scale.dtype)
    copies = pages_per_block + (k_scale is not None)  # the pages (and the block's scales)
    scratch = [
        smem((n_parts, rows, part), dtype, swizzle),  # q, then the output
        stored,
        stored,  # k, v as stored
        scales,
        scales,  # their per-token scales (int8, int4)
        *([None, None] if k_pages.dtype == dtype else [converted, converted]),  # dequantized
        smem((rows, block_kv), dtype, swizzle),  # p
        smem((n_parts, part, block_kv), dtype, swizzle) if params is not None else None,  # K^T
        plgpu.SMEM((rows,), jnp.float32),  # the rows' sink logits
        plgpu.Barrier(num_arrivals=1),  # q
        plgpu.Barrier(num_arrivals=1),  # sinks
        plgpu.Barrier(num_arrivals=copies, num_barriers=mk.NUM_SLOTS),
        plgpu.Barrier(num_arrivals=copies, num_barriers=mk.NUM_SLOTS),
    ]
    body = functools.partial(
        mk.rpa_kernel,
        page_size=page_size,
        group_pad=group_pad,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=params is not None,
    )
    kernel = kernel_call(
        body,
        jax.ShapeDtypeStruct(q_blk.shape, dtype),
        scratch,
        grid=(NB, KVH),
        grid_names=("block", "kv_head"),
        interpret=params,
        name=f"jaxkv_rpa_mgpu_g{group_pad}_kv{block_kv}",
    )
    return kernel(meta, tables, sinks_rows, q_blk, k_pages, v_pages, k_scale, v_scale)


def _block_scales(scale, tables, kv_lens, *, page_size, block_kv):
    """scale [KVH, P, page_size] -> [KVH, S, KB, block_kv]: each sequence's
    per-token scales in the order of its KV blocks, gathered along its block
    table (tables [S, KB * pages_per_block]; entries past its pages read
    page 0), so the kernel fetches a KV block's scales with one TMA copy: a
    page's alone (page_size * 4 or 2 bytes) is below the 128 bytes, a
    multiple of which a Mosaic GPU copy must move."""
    S, width = tables.shape
    n_pages = (kv_lens + page_size - 1) // page_size
    idx = jnp.where(jnp.arange(width)[None, :] < n_pages[:, None], tables, 0)
    gathered = jnp.take(scale, idx, axis=1, mode="clip")  # [KVH, S, width, page_size]
    return gathered.reshape(scale.shape[0], S, width * page_size // block_kv, block_kv)


def _next_pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def _block_metadata(kv_lens, cu_q_lens, num_seqs, *, block_q, num_blocks, block_kv, sliding_window):
    """Work blocks (gpu_kernel.work_blocks) and their kernel metadata:
    (meta [NB, META_FIELDS] int32, first token row [NB], rows [NB]). Blocks
    without rows get an empty KV range."""
    seq, row0, n_tok = work_blocks(cu_q_lens, num_seqs, block_q=block_q, num_blocks=num_blocks)
    live = n_tok > 0
    q_start = cu_q_lens[seq]
    pos0 = kv_lens[seq] - (cu_q_lens[seq + 1] - q_start) + (row0 - q_start)
    pos0 = jnp.where(live, pos0, 0)
    kv_hi = jnp.where(live, pos0 + n_tok, 0)
    kv_lo = 0 if sliding_window is None else jnp.maximum(pos0 - sliding_window + 1, 0)
    kb_lo = kv_lo // block_kv + jnp.zeros_like(pos0)
    kb_hi = jnp.where(live, (kv_hi + block_kv - 1) // block_kv, kb_lo)
    fields = {mk.SEQ: seq, mk.POS0: pos0, mk.KV_HI: kv_hi, mk.KB_LO: kb_lo, mk.KB_HI: kb_hi}
    meta = jnp.stack([fields[i] for i in range(mk.META_FIELDS)], axis=1).astype(jnp.int32)
    return meta, row0, n_tok


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "all_decode",
        "interpret",
        "block_kv",
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
    all_decode=None,
    interpret=False,
    block_kv=64,
):
    """Ragged paged attention on Hopper via Pallas Mosaic GPU (contract:
    `reference.py`; limits: the module docstring).

    q [T, H, D] bfloat16/float16; k_pages, v_pages [KVH, P, page_size, D] in
    q's dtype, or float8_e4m3fn / float8_e5m2 (no scales), or int8 with
    k_scale, v_scale [KVH, P, page_size] float32, or int4: uint8 [KVH, P,
    page_size, D // 2] with k_scale, v_scale bfloat16 (`kv_formats.py`);
    kv_lens [S], block_tables [S, pages_per_seq], cu_q_lens [S + 1] int32;
    num_seqs [] or [1] int32; sinks [H] float (learned attention sinks) or
    None -> [T, H, D] in q's dtype.

    Static: sm_scale, sliding_window, soft_cap; all_decode (True: the
    caller promises every live sequence brings at most one query row, so
    the grid has S work blocks instead of the ragged bound; None / False:
    any mix); interpret (True / InterpretGPUParams: CPU interpret mode);
    tuning: block_kv (keys per pipeline step, 64 or 128).
    """
    if q.dtype not in Q_DTYPES:
        raise ValueError(
            f"Mosaic GPU kernel: q must be bfloat16 or float16, got {q.dtype} "
            "(wgmma would run float32 as TF32; use the Triton kernel for float32)"
        )
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
        q_dtypes=Q_DTYPES,
        kernel="Mosaic GPU",
        sinks=sinks,
    )
    if D not in HEAD_DIMS:
        raise ValueError(f"Mosaic GPU kernel needs head dim in {HEAD_DIMS}, got {D}")
    if block_kv not in BLOCK_KVS:
        raise ValueError(f"Mosaic GPU kernel needs block_kv in {BLOCK_KVS}, got {block_kv}")
    if page_size < 8 or page_size & (page_size - 1) or page_size > block_kv:
        raise ValueError(
            f"Mosaic GPU kernel needs page_size a power of two from 8 to "
            f"block_kv={block_kv}, got {page_size}"
        )
    G = H // KVH
    group_pad = _next_pow2(G)
    if group_pad > mk.ROWS:
        raise ValueError(
            f"Mosaic GPU kernel needs at most {mk.ROWS} query heads per KV head, got {G}"
        )
    if all_decode not in (None, True, False):
        raise ValueError(f"all_decode must be None, True or False, got {all_decode!r}")
    interpret_params(interpret)  # validates it before tracing the kernel

    block_q = mk.ROWS // group_pad
    # Sum over sequences of cdiv(q_len, block_q) is at most this; a batch of
    # decodes has one block per sequence.
    num_blocks = min(S, T) if all_decode else (T + S * (block_q - 1)) // block_q
    num_seqs = jnp.minimum(jnp.reshape(num_seqs, ()).astype(jnp.int32), S)
    meta, row0, n_tok = _block_metadata(
        kv_lens,
        cu_q_lens,
        num_seqs,
        block_q=block_q,
        num_blocks=num_blocks,
        block_kv=block_kv,
        sliding_window=sliding_window,
    )
    pages_per_block = block_kv // page_size
    tables = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % pages_per_block)))

    # Gather the blocks' queries, the head dim in column parts (int4: two
    # halves): [NB, block_q, KVH, G_pad, D] -> [NB, KVH, n_parts, 64, part].
    n_parts = 2 if page_format(k_pages) == "int4" else 1
    t = jnp.arange(block_q)
    rows = row0[:, None] + t[None, :]
    live = t[None, :] < n_tok[:, None]  # [NB, block_q]
    q_g = jnp.pad(q.reshape(T, KVH, G, D), ((0, 0), (0, 0), (0, group_pad - G), (0, 0)))
    q_blk = jnp.where(live[:, :, None, None, None], q_g[jnp.minimum(rows, T - 1)], 0)
    q_blk = q_blk.reshape(num_blocks, block_q, KVH, group_pad, n_parts, D // n_parts)
    q_blk = q_blk.transpose(0, 2, 4, 1, 3, 5).reshape(num_blocks, KVH, n_parts, mk.ROWS, -1)

    # Row r of a KV head's tile is query head r % group_pad of that KV head.
    sinks_rows = sink_rows(sinks, KVH, G, group_pad, block_q)
    if k_scale is not None:
        k_scale, v_scale = (
            _block_scales(x, tables, kv_lens, page_size=page_size, block_kv=block_kv)
            for x in (k_scale, v_scale)
        )
    out = _rpa_kernel_call(
        meta,
        tables,
        sinks_rows,
        q_blk,
        k_pages,
        v_pages,
        k_scale,
        v_scale,
        group_pad=group_pad,
        block_kv=block_kv,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=interpret,
    )
    out = out.reshape(num_blocks, KVH, n_parts, block_q, group_pad, -1)[:, :, :, :, :G]
    out = out.transpose(0, 3, 1, 4, 2, 5).reshape(num_blocks * block_q, H, D)
    dest = jnp.where(live, rows, T).reshape(-1)  # T: out of range, dropped
    return jnp.zeros((T, H, D), q.dtype).at[dest].set(out, mode="drop")
