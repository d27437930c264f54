"""The paged KV cache: a functional, fixed-shape pytree.

Layout (one, for every backend): per layer l,
    k[l], v[l]: [KVH, P, page_size, D]      (kv_dtype: float32 / bfloat16 / int8 / fp8)
                [KVH, P, page_size, D // 2] uint8 for int4 (two values a byte)
    k_scale[l], v_scale[l]: [KVH, P, page_size] float32 for int8, bfloat16 for int4
                            [KVH] float32 for fp8 (one per KV head and layer)
The formats themselves (packing, scales, how kernels read them) are
`pallas_kernels.ragged_paged_attention.kv_formats`.

fp8 scales come from the checkpoint where it carries them (`preset_fp8_scales`:
its k_scale / v_scale per layer, for every KV head), else they are
calibrated in the jitted step: they start at 0 (not yet set), and the
first step that writes a live token into a layer sets each KV head's scale
from that step's largest |value| (with `FP8_HEADROOM` to spare: later
tokens may be larger); from then on they are fixed, so pages written early
stay valid (the prefix cache keeps them).
A slot is `page * page_size + offset`. Page 0 is the trash page: padded
tokens write there and no sequence ever owns it.

Layers are separate arrays (a tuple), not one [L, ...] array, so the jitted
step updates each layer in place (the whole cache is donated) and attention
reads a layer without slicing it out of a larger buffer. The per-layer shape
[KVH, P, page_size, D] is the one the Pallas kernels take; sharding splits
KVH over the "model" mesh axis.

Hybrid pool (`CacheConfig.local_pages`, models whose layers differ in
window): the sliding layers' arrays hold `local_pages` pages (page 0 again
the trash page), rings of pages per running sequence that keep only its
window (`jaxkv.model.attention.local_view`); the global layers hold
`num_pages`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv.config import CacheConfig, ModelConfig
from pallas_kernels.ragged_paged_attention.kv_formats import FP8_DTYPES, quantize_vectors

_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
    "int8": jnp.int8,
    "int4": jnp.uint8,
    **FP8_DTYPES,
}
# An fp8 scale maps the calibrating step's largest |value| to 1/FP8_HEADROOM
# of the format's largest finite value.
FP8_HEADROOM = 4.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k, v: L x [KVH, P, page_size, D] (D // 2 bytes for int4); k_scale,
    v_scale: L x [KVH, P, page_size] float32 for int8 / int4, L x [KVH] for
    fp8, else None. scores: L x [KVH, P, page_size] float32, the attention
    each slot has received (importance eviction), else None. routed: [X] int32 for a
    mixture of experts (else None), the choices each expert has received,
    summed over layers, counted by every step and wrapping at 2**32 (the
    host reads differences: `jaxkv.worker.runner`); it rides in the cache
    because the cache is what every program carries in and out."""

    k: tuple
    v: tuple
    k_scale: tuple | None = None
    v_scale: tuple | None = None
    routed: jax.Array | None = None
    scores: tuple | None = None  # L x [KVH, P, page_size] float32: attention each slot received

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_pages(self) -> int:
        """Pages of the largest layer (the global layers' in a hybrid pool)."""
        return max(x.shape[1] for x in self.k)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def quantized(self) -> bool:
        """int8, int4 or fp8."""
        return self.k_scale is not None

    @property
    def fp8(self) -> bool:
        """fp8 pages (one scale per KV head and layer)."""
        return self.k_scale is not None and self.k_scale[0].ndim == 1

    def rotated(self, model: ModelConfig) -> bool:
        """Whether the model rotates q, k and v into this cache
        (`jaxkv.model.llama`): int8, int4 and fp8 with calibrated scales
        (measured on SmolLM2 with fp8: log-likelihood delta to bfloat16 KV
        +0.018 nats/token rotated, +0.032 not); not fp8 with the
        checkpoint's scales, which describe the unrotated keys and values."""
        return self.quantized and not (self.fp8 and model.kv_cache_scales)

    def nbytes(self) -> int:
        return sum(x.nbytes for x in jax.tree_util.tree_leaves(self))


def layer_pages(model: ModelConfig, cache: CacheConfig) -> tuple[int, ...]:
    """Pages of each layer: `local_pages` for the sliding layers of a hybrid
    pool, `num_pages` for the rest."""
    return tuple(
        cache.local_pages if cache.local_pages and w is not None else cache.num_pages
        for w in model.windows
    )


def cache_shapes(model: ModelConfig, cache: CacheConfig) -> KVCache:
    """The cache as jax.ShapeDtypeStructs (for sizing and ahead-of-time compiles)."""
    dtype = _DTYPES[cache.kv_dtype]
    K, ps, D = model.num_kv_heads, cache.page_size, model.head_dim
    if cache.kv_dtype == "int4" and D % 2:
        raise ValueError(f"kv_dtype int4 packs two channels a byte: head_dim {D} is odd")
    fp8 = cache.kv_dtype in FP8_DTYPES
    pages = layer_pages(model, cache)
    Dp = D // 2 if cache.kv_dtype == "int4" else D
    layers = tuple(jax.ShapeDtypeStruct((K, P, ps, Dp), dtype) for P in pages)
    sdt = jnp.bfloat16 if cache.kv_dtype == "int4" else jnp.float32
    scales = tuple(jax.ShapeDtypeStruct((K,) if fp8 else (K, P, ps), sdt) for P in pages)
    q = cache.kv_dtype in ("int8", "int4") or fp8
    X = getattr(model, "num_experts", 0)
    acc = tuple(jax.ShapeDtypeStruct((K, P, ps), jnp.float32) for P in pages)
    return KVCache(
        k=layers,
        v=layers,
        k_scale=scales if q else None,
        v_scale=scales if q else None,
        routed=jax.ShapeDtypeStruct((X,), jnp.int32) if X else None,
        scores=acc if cache.scores else None,
    )


def cache_shardings(shapes: KVCache, sharding):
    """Each leaf's sharding: `sharding` (KV heads split) for the pages and
    scales, replicated for the routed counts."""
    from jax.sharding import NamedSharding, PartitionSpec

    tree = jax.tree_util.tree_map(lambda _: sharding, shapes)
    if shapes.routed is None:
        return tree
    return dataclasses.replace(tree, routed=NamedSharding(sharding.mesh, PartitionSpec()))


def create_cache(model: ModelConfig, cache: CacheConfig, sharding=None) -> KVCache:
    """A zeroed cache; `sharding` (optional) is every leaf's (made by one
    jitted call, so each device, of any process, zeroes only its shards)."""
    shapes = cache_shapes(model, cache)

    def zeros():
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    # One jitted call either way: op by op, each leaf's zeros would be its
    # own dispatch (60 of them for a 30-layer pool: half a second of a start).
    if sharding is None:
        return jax.jit(zeros)()
    return jax.jit(zeros, out_shardings=cache_shardings(shapes, sharding))()


def preset_fp8_scales(cache: KVCache, scales) -> KVCache:
    """An fp8 cache with its scales set from a checkpoint's: `scales` [L, 2]
    (k, v of each layer, `Llama.kv_cache_scales`) for every KV head, placed
    like the arrays they replace; the step then never calibrates them. Any
    other cache, or scales None, is returned unchanged."""
    import numpy as np

    if scales is None or not cache.fp8:
        return cache
    scales = np.asarray(scales, np.float32)
    if (
        scales.shape != (cache.num_layers, 2)
        or not np.all(scales > 0)
        or not np.all(np.isfinite(scales))
    ):
        raise ValueError(
            f"the checkpoint's fp8 KV scales must be [L, 2] = "
            f"[{cache.num_layers}, 2] positive finite values, got "
            f"{scales.shape}: {scales.ravel()[:4]}"
        )

    def put(old, s):
        return jax.device_put(np.full(old.shape, s, np.float32), old.sharding)

    return dataclasses.replace(
        cache,
        k_scale=tuple(put(x, s) for x, s in zip(cache.k_scale, scales[:, 0])),
        v_scale=tuple(put(x, s) for x, s in zip(cache.v_scale, scales[:, 1])),
    )


def write_pages(k, v, k_scale, v_scale, new_k, new_v, slot_mapping):
    """One layer's scatter: this step's keys/values new_k, new_v [T, KVH, D]
    into k, v [KVH, P, page_size, D] (and the scales: int8 / int4 [KVH, P,
    page_size], fp8 [KVH], None unless quantized) at slot_mapping [T]
    (padding rows point into the trash page). Returns the four updated
    arrays (fp8: the scales calibrated here if they were not yet)."""
    ps = k.shape[2]
    page, off = slot_mapping // ps, slot_mapping % ps
    nk = jnp.swapaxes(new_k, 0, 1)  # [KVH, T, D]
    nv = jnp.swapaxes(new_v, 0, 1)
    if k_scale is not None and k_scale.ndim == 1:  # fp8, one scale per KV head
        live = slot_mapping >= ps  # not the trash page
        (nk, k_scale), (nv, v_scale) = (
            _fp8(x, s, live, k.dtype) for x, s in ((nk, k_scale), (nv, v_scale))
        )
    elif k_scale is not None:
        fmt = "int4" if k.dtype == jnp.uint8 else "int8"
        nk, sk = quantize_vectors(nk, fmt)
        nv, sv = quantize_vectors(nv, fmt)
        k_scale = k_scale.at[:, page, off].set(sk)
        v_scale = v_scale.at[:, page, off].set(sv)
    k = k.at[:, page, off].set(nk.astype(k.dtype))
    v = v.at[:, page, off].set(nv.astype(v.dtype))
    return k, v, k_scale, v_scale


def _fp8(x, scale, live, dtype):
    """x [KVH, T, D] -> (x in fp8 `dtype`, scale [KVH]): scales still 0 are
    set from this step's live rows (`live` [T]) and then kept."""
    top = float(jnp.finfo(dtype).max)
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.where(live[None, :, None], jnp.abs(x), 0.0), axis=(1, 2))
    scale = jnp.where(scale > 0, scale, amax * FP8_HEADROOM / top)
    safe = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(x / safe[:, None, None], -top, top).astype(dtype), scale


def layer_arrays(cache: KVCache, layer: int) -> tuple:
    """(k, v, k_scale, v_scale) of one layer; the scales None unless quantized."""
    q = cache.quantized
    return (
        cache.k[layer],
        cache.v[layer],
        cache.k_scale[layer] if q else None,
        cache.v_scale[layer] if q else None,
    )


def replace_layer(cache: KVCache, layer: int, k, v, k_scale=None, v_scale=None) -> KVCache:
    """`cache` with one layer's arrays replaced."""

    def put(t, x):
        return None if t is None else t[:layer] + (x,) + t[layer + 1 :]

    return dataclasses.replace(
        cache,
        k=put(cache.k, k),
        v=put(cache.v, v),
        k_scale=put(cache.k_scale, k_scale),
        v_scale=put(cache.v_scale, v_scale),
    )


def copy_pages(cache: KVCache, src, dst, layers: tuple[int, ...] | None = None) -> KVCache:
    """Copy whole pages src[N] -> dst[N] in every layer, or in `layers` only
    (a hybrid pool's page ids belong to one group of layers). fp8's per-head
    scales are not per page and stay."""

    def cp(t):
        if t is None:
            return None
        return tuple(
            x.at[:, dst].set(x[:, src]) if (layers is None or i in layers) and x.ndim > 1 else x
            for i, x in enumerate(t)
        )

    return dataclasses.replace(
        cache,
        k=cp(cache.k),
        v=cp(cache.v),
        k_scale=cp(cache.k_scale),
        v_scale=cp(cache.v_scale),
        scores=cp(cache.scores),
    )


def paged_leaves(cache: KVCache) -> tuple:
    """Every array that holds data per page, in a fixed order: each layer's
    k, v, then the per-token scales (int8 / int4); [KVH, P, page_size, ...].
    fp8's per-head scales are not per page and are left out."""
    out = []
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        out += [x for x in (t or ()) if x.ndim > 1]
    return tuple(out)


def gather_pages(cache: KVCache, pages) -> tuple:
    """The contents of `pages` [W] (int32 page ids): one array per
    `paged_leaves` entry, [W, KVH, page_size, ...] (page first, the host
    tier's layout)."""
    return tuple(jnp.moveaxis(x[:, pages], 1, 0) for x in paged_leaves(cache))


def put_pages(cache: KVCache, pages, data) -> KVCache:
    """`cache` with `pages` [W] holding `data` (as `gather_pages` gives it)."""
    it = iter(data)

    def put(t):
        if t is None:
            return None
        return tuple(
            x.at[:, pages].set(jnp.moveaxis(next(it), 0, 1).astype(x.dtype)) if x.ndim > 1 else x
            for x in t
        )

    return dataclasses.replace(
        cache,
        k=put(cache.k),
        v=put(cache.v),
        k_scale=put(cache.k_scale),
        v_scale=put(cache.v_scale),
    )
