"""Attention kernels. (Temporary dispatcher: reference only; replaced by the
kernel dispatcher.)"""

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention as _reference


def ragged_paged_attention(*args, backend="auto", **kw):
    return _reference(*args, **kw)
