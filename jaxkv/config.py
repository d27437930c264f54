"""Frozen configuration dataclasses.

ModelConfig and RopeScaling live in `jaxkv.model_config` (re-exported here).

Shape legend used throughout jaxkv: B batch, T tokens, S sequences, L layers,
H query heads, K/KVH kv heads, D head dim, P pages, V vocab, E embed,
F MLP hidden (intermediate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxkv.model_config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling  # noqa: F401 (re-exported)
from jaxkv.units import parse_size
from pallas_kernels.ragged_paged_attention import BACKENDS as ATTENTION_BACKENDS

# KV cache formats (`pallas_kernels.ragged_paged_attention.kv_formats`); "fp8"
# is "fp8_e4m3".
KV_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry: `num_pages` pages (page 0 is the trash page) of
    `page_size` tokens each; `kv_dtype` is one of `KV_DTYPES`.
    `local_pages` (a hybrid pool; 0: none): the sliding layers' own pages,
    rings that hold each running sequence's window. `scores`: a float32
    accumulated-attention slot per token and KV head beside the pages
    (importance eviction, `jaxkv.core.kv.evict`)."""

    num_pages: int
    page_size: int = 16
    kv_dtype: str = "float32"
    local_pages: int = 0
    scores: bool = False

    def __post_init__(self):
        if self.num_pages < 2:
            raise ValueError(
                f"num_pages: need at least 2 (page 0 is reserved), got {self.num_pages}"
            )
        if self.page_size <= 0:
            raise ValueError(f"page_size: must be positive, got {self.page_size}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype: unsupported {self.kv_dtype!r} (one of {', '.join(KV_DTYPES)})"
            )


def _opt(default, help: str, **meta):
    """A config field with its help text (the CLI builds its options from these)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model. Every field is a `jaxkv` command option
    (``--max-num-seqs`` for `max_num_seqs`) and an `LLM(...)` keyword."""

    max_num_seqs: int = _opt(64, "most sequences in one step")
    max_num_batched_tokens: int = _opt(
        512, "token budget of one step; longer prompts are prefilled in chunks"
    )
    page_size: int = _opt(16, "tokens per KV cache page")
    num_pages: int | None = _opt(
        None, "KV pages in the pool (default: sized from --kv-cache-memory)"
    )
    kv_cache_memory: int | str | None = _opt(
        None,
        "bytes for the KV cache, units allowed (64MB, 2GiB) (default: "
        "--gpu-memory-utilization of free device memory; on CPU enough for "
        "--max-num-seqs sequences of --max-model-len tokens, at most that fraction of "
        "available RAM and 1 GiB)",
        parse="bytes",
    )
    gpu_memory_utilization: float = _opt(
        0.8, "fraction of free device memory for the KV cache when --kv-cache-memory is not given"
    )
    max_model_len: int | None = _opt(
        None,
        "cap on prompt + output tokens (default: the model's context, or the pool, if smaller)",
    )
    enable_prefix_caching: bool = _opt(True, "reuse the KV pages of shared prompt prefixes")
    kv_offload_memory: int | str | None = _opt(
        None,
        "host memory for KV pages leaving the device prefix cache, units allowed "
        "(8GB): a prefix found there is copied back instead of computed again, and a "
        "preempted sequence resumes from it (default: none)",
        parse="bytes",
    )
    kv_offload_dir: str | None = _opt(
        None,
        "a disk tier under the host tier: pages it drops are kept as files here and "
        "found again by a restarted engine (needs --kv-offload-memory)",
    )
    kv_offload_disk: int | str = _opt(
        "10GiB", "bytes the disk tier may use, units allowed", parse="bytes"
    )
    enable_chunked_prefill: bool = _opt(True, "split long prompts across steps")
    attention_backend: str = _opt(
        "auto",
        "auto: the Pallas kernel on TPU/GPU (Triton on GPU), the jnp reference on CPU; "
        "pallas on CPU runs the kernels in interpret mode (slow, for testing); "
        "pallas_mosaic_gpu: the Hopper Mosaic GPU kernel (bfloat16/float16 caches)",
        choices=ATTENTION_BACKENDS,
    )
    dtype: str = _opt("float32", "weight and activation dtype", choices=("float32", "bfloat16"))
    kv_dtype: str | None = _opt(
        None,
        "KV cache dtype (default: same as --dtype). int8 / int4: "
        "a scale per token and KV head; fp8 (= fp8_e4m3), fp8_e5m2: "
        "a scale per KV head and layer: the checkpoint's k_scale / "
        "v_scale where it carries them, else calibrated at start",
        choices=KV_DTYPES,
    )
    quantize: str | None = _opt(
        None,
        "int8: weight-only int8 matmul weights with per-channel scales (a quarter of "
        "the fp32 bytes; for accelerators). w8a8: int8 x int8 dots for steps of 16+ "
        "rows (faster batched decode on CPU), fp32 below",
        choices=("int8", "w8a8"),
    )
    gguf_blocks: bool | None = _opt(
        None,
        "keep a GGUF file's weights in their blocks (the layers' Q4_0 / Q4_1 / Q5_0 / "
        "Q8_0 / K-quant matmuls, a tied Q8_0 embedding), read by native CPU matmuls "
        "(float32) or Pallas kernels on TPU / GPU: the same products from a fraction of "
        "the bytes (one device). Default: on where it is measured faster, a GGUF model "
        "on one CPU device in float32 without other quantization or LoRA; off "
        "(--no-gguf-blocks) dequantizes to float32",
    )
    verify_checksums: bool = _opt(True, "check a jaxkv checkpoint's tensor checksums on load")
    num_decode_steps: int = _opt(8, "decode steps per jitted call when only decodes run")
    async_scheduling: bool | None = _opt(
        None,
        "overlapped scheduling: plan and dispatch the next step before reading this one's "
        "tokens (default: on for GPU/TPU, off on CPU)",
    )
    kv_eviction: str | None = _opt(
        None,
        "streaming: keep attention sinks plus a recent window (StreamingLLM), so "
        "generation runs past the pool with bounded memory; snapkv: at the end of a "
        "prompt keep, per KV head, the kv_budget tokens its last queries attend to "
        "most; h2o: while decoding keep the heavy hitters and the recent tokens "
        "within kv_budget (jaxkv.core.kv.evict)",
        choices=("streaming", "snapkv", "h2o"),
    )
    kv_budget: int | None = _opt(
        None, "tokens of KV a sequence keeps under snapkv / h2o eviction (per KV head and layer)"
    )
    snapkv_window: int = _opt(
        32,
        "snapkv: the last prompt queries whose attention picks the kept tokens (kept themselves)",
    )
    streaming_window: int = _opt(1024, "recent tokens kept by streaming eviction")
    hybrid_kv_cache: bool = _opt(
        True,
        "in a model whose layers differ in window (Gemma), the "
        "sliding layers keep only each sequence's window of pages",
    )
    num_sink_tokens: int = _opt(4, "first tokens kept by streaming eviction")
    program_cache: bool = _opt(
        True,
        "keep compiled step programs in $JAXKV_CACHE/programs "
        "for later starts (no tracing, no compiling)",
    )
    warmup: bool = _opt(
        True, "compile every step program at engine start (else each compiles on first use)"
    )
    seed: int = _opt(0, "base seed of the engine's sampler")
    tensor_parallel_size: int = _opt(
        1,
        "devices the model is split over (tensor parallel over the mesh's 'model' axis; "
        "with several processes, every device of the job)",
    )
    enable_expert_parallel: bool = _opt(
        False,
        "mixture-of-experts layers: split whole experts over the tensor-parallel "
        "devices (expert parallel) instead of every expert's intermediate columns",
    )
    num_processes: int | None = _opt(
        None,
        "processes (hosts) of a multi-process job, joined through jax.distributed "
        "(default: $JAXKV_NUM_PROCESSES, else one)",
    )
    process_id: int | None = _opt(
        None, "this process's index in the job, 0 takes the requests (default: $JAXKV_PROCESS_ID)"
    )
    coordinator_address: str | None = _opt(
        None, "host:port of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS)"
    )
    enable_lora: bool = _opt(
        False, "serve LoRA adapters (PEFT folders) over the base model, mixed in one batch"
    )
    max_loras: int = _opt(
        1, "LoRA adapters held on the device at once (distinct adapters in one step)"
    )
    max_lora_rank: int = _opt(16, "the highest LoRA rank an adapter may have")
    max_cpu_loras: int | None = _opt(
        None,
        "LoRA adapters whose factors are kept in host memory (least recently used "
        "dropped and read again from the folder when named; default max_loras)",
    )
    speculative_config: dict | None = _opt(
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": '
        '4} (prompt lookup; "prompt_lookup_max" / "prompt_lookup_min" the n-gram '
        'lengths tried), {"method": "draft_model", "model": PATH, '
        '"num_speculative_tokens": 4} or {"method": "eagle3", "model": HEAD_DIR, '
        '"num_speculative_tokens": 4} (an EAGLE-3 head, e.g. from jaxkv train-draft); '
        "outputs are exactly those without it",
        parse="json",
    )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (None: off)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.speculative
        return spec.num_speculative_tokens if spec is not None else 0

    def __post_init__(self):
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "page_size",
            "num_decode_steps",
            "tensor_parallel_size",
            "max_loras",
            "max_lora_rank",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            v = getattr(self, f.name)
            if choices and v is not None and v not in choices:
                raise ValueError(
                    f"{f.name}: must be one of {choices}"
                    f"{' or None' if f.default is None else ''}, got {v!r}"
                )
        for name in ("kv_cache_memory", "kv_offload_memory", "kv_offload_disk"):
            if isinstance(getattr(self, name), str):  # "64MB", "1GiB": units as on the command line
                try:
                    object.__setattr__(self, name, parse_size(getattr(self, name)))
                except ValueError as e:
                    raise ValueError(f"{name}: {e}") from None
        for name in (
            "num_pages",
            "kv_cache_memory",
            "max_model_len",
            "num_processes",
            "kv_offload_memory",
            "kv_offload_disk",
            "max_cpu_loras",
        ):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"{name}: must be a positive integer or None, got {v!r}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(
                f"num_pages: need at least 2 (page 0 is reserved), got {self.num_pages}"
            )
        if self.kv_eviction in ("snapkv", "h2o"):
            _check_importance_eviction(self)
        if self.kv_offload_dir is not None and self.kv_offload_memory is None:
            raise ValueError(
                "kv_offload_dir: the disk tier sits under the host tier; set kv_offload_memory too"
            )
        if self.kv_offload_memory is not None and not self.enable_prefix_caching:
            raise ValueError(
                "kv_offload_memory: the host tier keeps prefix-cache pages; it "
                "needs enable_prefix_caching"
            )
        if self.streaming_window <= 0 or self.num_sink_tokens < 0:
            raise ValueError("streaming_window must be positive and num_sink_tokens >= 0")
        if self.process_id is not None and (
            not isinstance(self.process_id, int)
            or isinstance(self.process_id, bool)
            or self.process_id < 0
        ):
            raise ValueError(
                f"process_id: must be a non-negative integer or None, got {self.process_id!r}"
            )
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # names a bad key or value
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}"
            )


def _check_importance_eviction(c: EngineConfig) -> None:
    """snapkv / h2o: a budget, and none of what a compacted sequence cannot
    share or replay (refused by name)."""
    name = c.kv_eviction
    b = c.kv_budget
    if not isinstance(b, int) or isinstance(b, bool) or b < 2 * c.page_size:
        raise ValueError(
            f"kv_budget: kv_eviction={name!r} needs a budget of at least two "
            f"pages ({2 * c.page_size} tokens), got {b!r}"
        )
    if name == "snapkv" and not 0 < c.snapkv_window < b:
        raise ValueError(
            f"snapkv_window: must be positive and below kv_budget ({b}), got {c.snapkv_window}"
        )
    for cond, what in (
        (c.kv_offload_memory is not None, "the host tier (kv_offload_memory)"),
        (c.speculative_config is not None, "speculative decoding"),
        (
            c.tensor_parallel_size > 1 or (c.num_processes or 1) > 1,
            "tensor parallel or several processes",
        ),
        (c.async_scheduling, "overlapped scheduling (async_scheduling)"),
    ):
        if cond:
            raise ValueError(
                f"kv_eviction={name!r} compacts each sequence's pages in place; "
                f"it does not run with {what}"
            )
    # A compacted page holds no prefix any other prompt could share.
    object.__setattr__(c, "enable_prefix_caching", False)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`EngineConfig.speculative_config`, parsed by
    `from_dict`). method "ngram": prompt lookup, the last n tokens (n from
    prompt_lookup_max down to prompt_lookup_min) matched against the
    sequence's own earlier tokens, the tokens that followed proposed.
    method "draft_model": a smaller model (`model`, any path jaxkv loads,
    same vocabulary) proposes greedily. method "eagle3": an EAGLE-3 draft
    head (`model`, a folder in the Hugging Face layout, `checkpoints.eagle3`)
    proposes greedily from the target's own hidden states
    (`jaxkv.core.spec.eagle`). num_speculative_tokens: k, the most
    proposals a sequence brings to one step (static: one program per k).
    adaptive: speculate only in steps where it is expected to pay, from the
    measured cost of verifying and the acceptance so far
    (`jaxkv.core.spec.decode.SpecGate`); False: whenever there are
    proposals."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    adaptive: bool = True

    METHODS = ("ngram", "draft_model", "eagle3")
    MAX_TOKENS = 16

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpeculativeConfig:
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, Mapping):
            raise ValueError(f"speculative_config: must be a JSON object, got {d!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}"
            )
        method = d.get("method")
        if method not in cls.METHODS:
            raise ValueError(
                f"speculative_config.method: must be one of {cls.METHODS}, got {method!r}"
            )
        k = d.get("num_speculative_tokens", 4)
        for name, v in (
            ("num_speculative_tokens", k),
            ("prompt_lookup_max", d.get("prompt_lookup_max", 4)),
            ("prompt_lookup_min", d.get("prompt_lookup_min", 2)),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(
                    f"speculative_config.{name}: must be a positive integer, got {v!r}"
                )
        if k > cls.MAX_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens: at most {cls.MAX_TOKENS}, got {k}"
            )
        lo, hi = d.get("prompt_lookup_min", 2), d.get("prompt_lookup_max", 4)
        if "prompt_lookup_min" in d and "prompt_lookup_max" not in d:
            hi = max(hi, lo)
        elif "prompt_lookup_max" in d and "prompt_lookup_min" not in d:
            lo = min(lo, hi)
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min {lo} exceeds prompt_lookup_max {hi}"
            )
        model = d.get("model")
        if method in ("draft_model", "eagle3") and (not isinstance(model, str) or not model):
            what = "draft model's name" if method == "draft_model" else "EAGLE-3 head's folder"
            raise ValueError(
                f"speculative_config.model: the {what} or path is required with method {method!r}"
            )
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config.model: only with method 'draft_model' or 'eagle3'")
        adaptive = d.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(
                f"speculative_config.adaptive: must be true or false, got {adaptive!r}"
            )
        return cls(method, k, hi, lo, model, adaptive)
