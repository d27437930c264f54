"""Input checks shared by the Pallas kernels: the contract's shapes and
dtypes, with a ValueError naming what is wrong. Each kernel adds the
constraints of its hardware (tile sizes, supported dtypes) on top."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.kv_formats import check_pages


def check_sinks(sinks, num_heads):
    """Learned attention sinks (`sinks.py`) are None or a floating array
    [H]: one logit per query head."""
    if sinks is None:
        return
    shape, dtype = getattr(sinks, "shape", None), getattr(sinks, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(
            f"sinks must be None or a floating array [H] = [{num_heads}], "
            f"got {type(sinks).__name__}"
        )
    if tuple(shape) != (num_heads,):
        raise ValueError(
            f"sinks must be [H] = [{num_heads}] (one logit per query head), "
            f"got shape {tuple(shape)}"
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"sinks must be a floating array, got {jnp.dtype(dtype).name}")


def check_inputs(
    q,
    k_pages,
    v_pages,
    kv_lens,
    block_tables,
    cu_q_lens,
    num_seqs,
    *,
    sliding_window,
    soft_cap,
    k_scale,
    v_scale,
    q_dtypes,
    kernel: str,
    sinks=None,
):
    """Validate a ragged paged attention call; returns (T, H, D, KVH, P,
    page_size, S)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    T, H, D = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages/v_pages must both be [KVH, P, page_size, D], got "
            f"{k_pages.shape} and {v_pages.shape}"
        )
    KVH, P, page_size, _ = k_pages.shape
    fmt = check_pages(k_pages, v_pages, k_scale, v_scale, D)
    if H % KVH:
        raise ValueError(f"num query heads {H} is not a multiple of num kv heads {KVH}")
    if q.dtype not in q_dtypes:
        names = ", ".join(jnp.dtype(d).name for d in q_dtypes)
        raise ValueError(f"{kernel} kernel: q must be one of {names}, got {q.dtype}")
    if fmt == "float" and k_pages.dtype != q.dtype:
        raise ValueError(
            f"pages dtype {k_pages.dtype} must match q dtype {q.dtype} "
            f"(or be int8 / int4 with scales, or fp8)"
        )
    S = kv_lens.shape[0]
    if (
        kv_lens.shape != (S,)
        or block_tables.ndim != 2
        or block_tables.shape[0] != S
        or cu_q_lens.shape != (S + 1,)
    ):
        raise ValueError(
            f"inconsistent sequence metadata: kv_lens {kv_lens.shape}, "
            f"block_tables {block_tables.shape}, cu_q_lens {cu_q_lens.shape}"
        )
    if jnp.size(num_seqs) != 1:
        raise ValueError(f"num_seqs must be a scalar, got shape {jnp.shape(num_seqs)}")
    for name, a in (("kv_lens", kv_lens), ("block_tables", block_tables), ("cu_q_lens", cu_q_lens)):
        if a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {a.dtype}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be positive, got {soft_cap}")
    check_sinks(sinks, H)
    return T, H, D, KVH, P, page_size, S
