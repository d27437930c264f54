"""Ragged paged attention as a Pallas Mosaic GPU kernel for Hopper (sm_90a).

Same contract and numbers as `reference.py` (see its module docstring):
q [T, H, D], k_pages / v_pages [KVH, P, page_size, D] -> [T, H, D].

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
The kernel body is `mosaic_gpu_kernel.py`. Queries are cut into work blocks
of block_q = 64 // G_pad tokens that never span two sequences (G_pad: the
query heads per KV head rounded up to a power of two), so a block of one KV
head is exactly 64 rows, token major: one warpgroup's wgmma tile (GQA
without copying K/V; a decode is one token x G_pad heads in its own block).
The wrapper gathers the blocks' queries into [NB, KVH, 64, D] (and scatters
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

Costs this version still pays (next steps, once it runs on a GPU): the
wrapper's gather of the queries and scatter of the output; a decode uses
G_pad of its block's 64 rows; no context splits (flash decoding) for few
long decodes; P makes a round trip through shared memory (see interpret
below); one warpgroup per program, without producer / consumer warp
specialization.

Numerics: float32 accumulation and softmax; P rounded to the input dtype
before the value product, as the Triton kernel does.

Limits (ValueError otherwise)
-----------------------------
- q and pages bfloat16 or float16: wgmma computes float32 operands as TF32
  (about 1e-3 relative error), beyond the float32 tolerance the contract
  holds the other kernels to; float32 caches use `gpu.py`.
- no int8 pages (k_scale / v_scale).
- head dim 64 or 128 (128-byte swizzled tiles of 64 elements).
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
import inspect

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention import mosaic_gpu_kernel as mk
from pallas_kernels.ragged_paged_attention.checks import check_inputs
from pallas_kernels.ragged_paged_attention.gpu_kernel import work_blocks
from pallas_kernels.ragged_paged_attention.sinks import sink_rows

Q_DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
BLOCK_KVS = (64, 128)
_SWIZZLE_BYTES = 128


def _api():
    """plgpu, or a clear error when this jax has no Mosaic GPU Pallas."""
    if mk.plgpu is None:
        raise RuntimeError("this jax has no jax.experimental.pallas.mosaic_gpu; the Mosaic GPU "
                           "kernel needs jax >= 0.10 (use gpu.py, the Triton kernel)")
    return mk.plgpu


def _interpret_params(interpret):
    """The `interpret=` value for plgpu.kernel: None (compiled) or the GPU
    interpret mode's parameters. `interpret=True` alone would pick Pallas'
    generic interpreter, which knows no barriers or TMA."""
    if interpret is False or interpret is None:
        return None
    try:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    except ImportError as e:
        raise RuntimeError(f"this jax ({jax.__version__}) has no Mosaic GPU interpret mode "
                           "(jax._src.pallas.mosaic_gpu.interpret, jax >= 0.10)") from e
    if interpret is True:
        return InterpretGPUParams()
    if not isinstance(interpret, InterpretGPUParams):
        raise ValueError(f"interpret must be a bool or an InterpretGPUParams, got {interpret!r}")
    return interpret


def _smem(shape, dtype):
    """A shared memory buffer in wgmma's tiled, 128-byte swizzled layout."""
    plgpu = _api()
    elems = _SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)),
                                                plgpu.SwizzleTransform(_SWIZZLE_BYTES)))


def _kernel_call(body, out_type, scratch, *, grid, grid_names, interpret, name):
    """plgpu.kernel across jax versions: the output / scratch keywords were
    renamed (out_shape / scratch_shapes -> out_type / scratch_types)."""
    plgpu = _api()
    params = inspect.signature(plgpu.kernel).parameters
    out_kw = "out_type" if "out_type" in params else "out_shape"
    scratch_kw = "scratch_types" if "scratch_types" in params else "scratch_shapes"
    kw = {out_kw: out_type, scratch_kw: scratch}
    if "kernel_name" in inspect.signature(plgpu.Mesh).parameters:  # a mesh keyword
        kw["kernel_name"] = name
    return plgpu.kernel(body, grid=grid, grid_names=grid_names, interpret=interpret, **kw)


def _rpa_kernel_call(meta, tables, sinks_rows, q_blk, k_pages, v_pages, *, group_pad, block_kv,
                     sm_scale, sliding_window, soft_cap, interpret):
    """q_blk [NB, KVH, 64, D], sinks_rows [KVH, 64] f32 -> out [NB, KVH, 64, D]
    (q's dtype)."""
    plgpu = _api()
    NB, KVH, rows, D = q_blk.shape
    dtype = q_blk.dtype
    page_size = k_pages.shape[2]
    pages_per_block = block_kv // page_size
    params = _interpret_params(interpret)
    scratch = [
        _smem((rows, D), dtype),  # q, then the output
        _smem((mk.NUM_SLOTS, block_kv, D), dtype),  # k
        _smem((mk.NUM_SLOTS, block_kv, D), dtype),  # v
        _smem((rows, block_kv), dtype),  # p
        _smem((D, block_kv), dtype) if params is not None else None,  # K^T (interpret)
        plgpu.SMEM((rows,), jnp.float32),  # the rows' sink logits
        plgpu.Barrier(num_arrivals=1),  # q
        plgpu.Barrier(num_arrivals=1),  # sinks
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=mk.NUM_SLOTS),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=mk.NUM_SLOTS),
    ]
    body = functools.partial(mk.rpa_kernel, page_size=page_size, group_pad=group_pad,
                             sm_scale=sm_scale, sliding_window=sliding_window,
                             soft_cap=soft_cap, interpret=params is not None)
    kernel = _kernel_call(body, jax.ShapeDtypeStruct(q_blk.shape, dtype), scratch,
                          grid=(NB, KVH), grid_names=("block", "kv_head"), interpret=params,
                          name=f"jaxkv_rpa_mgpu_g{group_pad}_kv{block_kv}")
    return kernel(meta, tables, sinks_rows, q_blk, k_pages, v_pages)


def _next_pow2(n):
    return 1 << max(0, (n - 1).bit_length())


def _block_metadata(kv_lens, cu_q_lens, num_seqs, *, block_q, num_blocks, block_kv,
                    sliding_window):
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


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "sliding_window", "soft_cap", "all_decode", "interpret", "block_kv"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                           sm_scale, sliding_window=None, soft_cap=None, sinks=None,
                           k_scale=None, v_scale=None, all_decode=None, interpret=False,
                           block_kv=64):
    """Ragged paged attention on Hopper via Pallas Mosaic GPU (contract:
    `reference.py`; limits: the module docstring).

    q [T, H, D] bfloat16/float16; k_pages, v_pages [KVH, P, page_size, D] in
    q's dtype; kv_lens [S], block_tables [S, pages_per_seq], cu_q_lens [S + 1]
    int32; num_seqs [] or [1] int32; sinks [H] float (learned attention
    sinks) or None -> [T, H, D] in q's dtype.

    Static: sm_scale, sliding_window, soft_cap; all_decode (True: the
    caller promises every live sequence brings at most one query row, so
    the grid has S work blocks instead of the ragged bound; None / False:
    any mix); interpret (True / InterpretGPUParams: CPU interpret mode);
    tuning: block_kv (keys per pipeline step, 64 or 128).
    """
    if q.dtype not in Q_DTYPES:
        raise ValueError(f"Mosaic GPU kernel: q must be bfloat16 or float16, got {q.dtype} "
                         "(wgmma would run float32 as TF32; use the Triton kernel for float32)")
    T, H, D, KVH, P, page_size, S = check_inputs(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
        sliding_window=sliding_window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
        q_dtypes=Q_DTYPES, kernel="Mosaic GPU", sinks=sinks)
    if k_scale is not None:
        raise ValueError("Mosaic GPU kernel: int8 pages (k_scale/v_scale) are not supported; "
                         "use the Triton kernel")
    if D not in HEAD_DIMS:
        raise ValueError(f"Mosaic GPU kernel needs head dim in {HEAD_DIMS}, got {D}")
    if block_kv not in BLOCK_KVS:
        raise ValueError(f"Mosaic GPU kernel needs block_kv in {BLOCK_KVS}, got {block_kv}")
    if page_size < 8 or page_size & (page_size - 1) or page_size > block_kv:
        raise ValueError(f"Mosaic GPU kernel needs page_size a power of two from 8 to "
                         f"block_kv={block_kv}, got {page_size}")
    G = H // KVH
    group_pad = _next_pow2(G)
    if group_pad > mk.ROWS:
        raise ValueError(f"Mosaic GPU kernel needs at most {mk.ROWS} query heads per KV head, "
                         f"got {G}")
    if all_decode not in (None, True, False):
        raise ValueError(f"all_decode must be None, True or False, got {all_decode!r}")
    _interpret_params(interpret)  # validates it before tracing the kernel

    block_q = mk.ROWS // group_pad
    # Sum over sequences of cdiv(q_len, block_q) is at most this; a batch of
    # decodes has one block per sequence.
    num_blocks = min(S, T) if all_decode else (T + S * (block_q - 1)) // block_q
    num_seqs = jnp.minimum(jnp.reshape(num_seqs, ()).astype(jnp.int32), S)
    meta, row0, n_tok = _block_metadata(kv_lens, cu_q_lens, num_seqs, block_q=block_q,
                                        num_blocks=num_blocks, block_kv=block_kv,
                                        sliding_window=sliding_window)
    pages_per_block = block_kv // page_size
    tables = jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % pages_per_block)))

    # Gather the blocks' queries: [NB, block_q, KVH, G_pad, D] -> [NB, KVH, 64, D].
    t = jnp.arange(block_q)
    rows = row0[:, None] + t[None, :]
    live = t[None, :] < n_tok[:, None]  # [NB, block_q]
    q_g = jnp.pad(q.reshape(T, KVH, G, D), ((0, 0), (0, 0), (0, group_pad - G), (0, 0)))
    q_blk = jnp.where(live[:, :, None, None, None], q_g[jnp.minimum(rows, T - 1)], 0)
    q_blk = q_blk.transpose(0, 2, 1, 3, 4).reshape(num_blocks, KVH, mk.ROWS, D)

    # Row r of a KV head's tile is query head r % group_pad of that KV head.
    sinks_rows = sink_rows(sinks, KVH, G, group_pad, block_q)
    out = _rpa_kernel_call(meta, tables, sinks_rows, q_blk, k_pages, v_pages,
                           group_pad=group_pad, block_kv=block_kv, sm_scale=sm_scale,
                           sliding_window=sliding_window, soft_cap=soft_cap, interpret=interpret)
    out = out.reshape(num_blocks, KVH, block_q, group_pad, D)[:, :, :, :G]
    out = out.transpose(0, 2, 1, 3, 4).reshape(num_blocks * block_q, H, D)
    dest = jnp.where(live, rows, T).reshape(-1)  # T: out of range, dropped
    return jnp.zeros((T, H, D), q.dtype).at[dest].set(out, mode="drop")
