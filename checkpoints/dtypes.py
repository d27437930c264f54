"""Weight dtypes a jaxkv checkpoint stores, and casting to them."""

from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def resolve_dtype(dtype: str | np.dtype | None) -> np.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` (or a numpy dtype) -> np.dtype."""
    if dtype is None:
        return DTYPES["float32"]
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype: unsupported {dtype!r}; supported: {sorted(DTYPES)}")
        return DTYPES[dtype]
    dt = np.dtype(dtype)
    if dt not in DTYPES.values():
        raise ValueError(f"dtype: unsupported {dt}; supported: {sorted(DTYPES)}")
    return dt


def cast_params(
    params: Mapping[str, np.ndarray], dtype: str | np.dtype | None
) -> dict[str, np.ndarray]:
    """Cast every array to ``dtype`` (no copy for arrays already of that dtype)."""
    dt = resolve_dtype(dtype)
    return {k: np.asarray(v).astype(dt, copy=False) for k, v in params.items()}
