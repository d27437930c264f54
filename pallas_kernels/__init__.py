"""Attention kernels for jaxkv (no jaxkv imports): per kernel a folder with a
pure-jnp `reference.py` (the spec), `tpu.py` (Pallas Mosaic TPU), `gpu.py`
(Pallas GPU) and one public entry that picks by backend.

`ragged_paged_attention` below is that entry (a function). It shadows the
subpackage of the same name as an attribute of this package, so import the
subpackage's modules with ``from pallas_kernels.ragged_paged_attention import
reference`` (or ``...reference import ragged_paged_attention``), not
``import pallas_kernels.ragged_paged_attention.reference as ...``.
"""

from pallas_kernels.ragged_paged_attention import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
