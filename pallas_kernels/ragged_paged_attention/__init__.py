"""Ragged paged attention: one entry that picks the implementation.

    ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens,
                           num_seqs, *, sm_scale, sliding_window=None,
                           soft_cap=None, sinks=None, k_scale=None, v_scale=None,
                           num_sink_tokens=0, all_decode=None, backend="auto",
                           pallas_target=None, interpret=None,
                           kernel_options=None, platform=None) -> [T, H, D]

The contract (shapes, masking, padding rows) is `reference.py`'s. sinks [H]
(float, or None): learned attention sinks as in gpt-oss (`sinks.py`), one
logit per query head in its rows' softmax denominator, carrying no value;
every backend takes them. num_sink_tokens (StreamingLLM's sink tokens kept
in a sliding window) is another thing, and the reference's alone. Backends:

- "auto": the platform's kernel: TPU -> `tpu.py` (Mosaic), GPU -> `gpu.py`
  (Pallas Triton, CUDA), anything else (CPU) -> the reference, whose long
  prefill chunks run as `cpu.py`'s native flash attention (MKL) where that
  is built and takes the case, the pure-jnp dense blocks otherwise.
- "reference": the pure-jnp reference on any platform.
- "pallas": a Pallas kernel. On TPU / GPU the platform's own (pallas_target,
  if given, must name it: "tpu", or on GPU "gpu" for Triton, the default,
  or "mosaic_gpu" for the Hopper kernel, `mosaic_gpu.py`); on CPU it runs in
  interpret mode, the TPU kernel by default (pallas_target="gpu" for the
  Triton one, "mosaic_gpu" for the Hopper one). Asking for a kernel the
  platform cannot run raises ValueError.
- "pallas_mosaic_gpu": "pallas" with pallas_target="mosaic_gpu" (one name
  for the engine's `attention_backend`). The Triton kernel stays the GPU
  default: the Mosaic GPU one is tested in interpret mode and lowered for
  CUDA, but has not run on a GPU yet, and takes bfloat16 / float16 only.

all_decode (static): True promises that every live sequence brings at most
one query row (a batch of decodes), False that some bring more; with
either, implementations that keep a decode and a prefill configuration
compile only the one that applies. None (the default) compiles both and
picks at run time. A caller that knows the batch (the engine's scheduler
does) saves the compile time of the other path.

interpret (Pallas only): None picks the platform default (compiled on TPU /
GPU, interpreted on CPU); True, or a `pltpu.InterpretParams` for the TPU
kernel, forces interpret mode. kernel_options: tuning keywords passed to the
chosen kernel (see `tpu.ragged_paged_attention` / `gpu.ragged_paged_attention`).

The platform is `jax.default_backend()`, read at trace time, unless
`platform` ("cpu", "gpu", "tpu") names the one the program is lowered for
(ahead-of-time compiles without that device).

Only the implementation a call picks is imported (the Pallas backends pull
in Triton and Mosaic lowering that a CPU run never needs), the first time
it is picked.
"""

from __future__ import annotations

import importlib

import jax

BACKENDS = ("auto", "reference", "pallas", "pallas_mosaic_gpu")
# The page formats (`kv_formats.page_format`) each implementation reads
# (the reference's include the native CPU kernel beneath it): every one.
# What a GPU cannot do is `check_format`'s: Triton converts fp8 e4m3 from
# compute capability 8.9 (Ada, Hopper) on.
KERNEL_FORMATS = {
    impl: ("float", "int8", "int4", "fp8") for impl in ("reference", "tpu", "gpu", "mosaic_gpu")
}
_FP8_MIN_CAPABILITY = (8, 9)
PALLAS_TARGETS = ("tpu", "gpu", "mosaic_gpu")
_TARGET_PLATFORM = {"tpu": "tpu", "gpu": "gpu", "mosaic_gpu": "gpu"}


def resolve(backend="auto", pallas_target=None, interpret=None, platform=None):
    """-> (implementation, interpret) where implementation is "reference",
    "tpu", "gpu" or "mosaic_gpu" and interpret the value to pass to that
    kernel. Raises ValueError for a request the platform cannot serve."""
    platform = platform or jax.default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "pallas_mosaic_gpu":
        if pallas_target not in (None, "mosaic_gpu"):
            raise ValueError(
                f"backend 'pallas_mosaic_gpu' is pallas_target='mosaic_gpu' "
                f"(got pallas_target={pallas_target!r})"
            )
        backend, pallas_target = "pallas", "mosaic_gpu"
    if pallas_target is not None and pallas_target not in PALLAS_TARGETS:
        raise ValueError(f"pallas_target must be one of {PALLAS_TARGETS}, got {pallas_target!r}")
    if backend != "pallas" and pallas_target is not None:
        raise ValueError(
            f"pallas_target applies to backend='pallas' only (got backend={backend!r})"
        )
    if backend == "reference" or (backend == "auto" and platform not in PALLAS_TARGETS):
        if interpret is not None:
            raise ValueError(
                "interpret applies to Pallas kernels only; the reference is "
                f"selected here (backend={backend!r}, platform {platform!r})"
            )
        return "reference", None
    on_device = platform in PALLAS_TARGETS
    target = pallas_target or (platform if on_device else "tpu")
    if on_device and _TARGET_PLATFORM[target] != platform:
        raise ValueError(
            f"the {target.upper()} Pallas kernel cannot run on a {platform} "
            f"platform; use pallas_target={platform!r} or backend='reference'"
        )
    if interpret is None:
        interpret = not on_device
    if not on_device and interpret is False:
        raise ValueError(
            f"Pallas kernels on the {platform!r} platform run only in interpret "
            "mode; pass interpret=None/True, or backend='reference'"
        )
    return target, interpret


def check_format(impl: str, fmt: str, device=None) -> None:
    """ValueError unless implementation `impl` ("reference", "tpu", "gpu",
    "mosaic_gpu") reads pages of format `fmt` (`kv_formats.page_format`) on
    `device` (a jax GPU device, or None: not checked): fp8 pages need compute
    capability 8.9 or newer for the Triton and Mosaic GPU kernels."""
    name = {
        "tpu": "Pallas TPU",
        "gpu": "Pallas Triton GPU",
        "mosaic_gpu": "Mosaic GPU",
        "reference": "reference",
    }[impl]
    if fmt not in KERNEL_FORMATS[impl]:
        raise ValueError(
            f"the {name} attention kernel does not read {fmt} KV pages (it reads "
            f"{', '.join(KERNEL_FORMATS[impl])}); use backend='reference' or "
            "another kv_dtype"
        )
    capability = getattr(device, "compute_capability", None)
    if fmt == "fp8" and impl in ("gpu", "mosaic_gpu") and capability:
        have = tuple(int(x) for x in str(capability).split(".")[:2])
        if have < _FP8_MIN_CAPABILITY:
            raise ValueError(
                f"the {name} attention kernel reads fp8 KV pages on compute "
                f"capability 8.9 or newer (Ada, Hopper); this GPU is "
                f"{capability}: use kv_dtype int8 or int4"
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
    num_sink_tokens=0,
    all_decode=None,
    backend="auto",
    pallas_target=None,
    interpret=None,
    kernel_options=None,
    platform=None,
):
    """Ragged paged attention on the chosen backend (see the module docstring).
    q [T, H, D]; k_pages, v_pages [KVH, P, page_size, D]; kv_lens [S];
    block_tables [S, pages_per_seq]; cu_q_lens [S + 1]; num_seqs []; sinks
    [H] or None -> [T, H, D]."""
    impl, interpret = resolve(backend, pallas_target, interpret, platform)
    from pallas_kernels.ragged_paged_attention.kv_formats import page_format

    check_format(impl, page_format(k_pages))
    if num_sink_tokens and impl != "reference":
        raise ValueError(
            "num_sink_tokens (sink tokens for streaming eviction) is supported by "
            "the reference backend only (learned `sinks` logits: every backend)"
        )
    if all_decode not in (None, True, False):
        raise ValueError(f"all_decode must be None, True or False, got {all_decode!r}")
    kw = dict(
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        sinks=sinks,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    kernel = importlib.import_module(f"{__name__}.{impl}")
    if impl == "reference":
        if kernel_options:
            raise ValueError("kernel_options apply to Pallas kernels only")
        # "auto" on CPU: the reference with its dense prefill blocks in
        # native code (cpu.py) where that is built; "reference" stays jnp.
        native = backend == "auto" and (platform or jax.default_backend()) == "cpu"
        return kernel.ragged_paged_attention(
            *args, **kw, num_sink_tokens=num_sink_tokens, all_decode=all_decode, native_cpu=native
        )
    if impl != "tpu":  # the TPU kernel has one configuration
        kw["all_decode"] = all_decode
    return kernel.ragged_paged_attention(*args, **kw, interpret=interpret, **(kernel_options or {}))


__all__ = [
    "ragged_paged_attention",
    "resolve",
    "check_format",
    "BACKENDS",
    "PALLAS_TARGETS",
    "KERNEL_FORMATS",
]
