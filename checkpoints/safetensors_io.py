"""Hugging Face checkpoints: ``config.json`` + safetensors (single or sharded).

Files are read with the `safetensors` library (bfloat16 comes back as
ml_dtypes' numpy type), which validates each header and the tensors' data
offsets; a truncated or corrupt file raises a ValueError naming the file
instead of the library's own error.

HF tensor names map to jaxkv names through the explicit table `hf_tensor_map`
(gpt-fast ``convert_hf_checkpoint`` style): every tensor's shape is checked and
missing or unexpected tensors raise. Legend as in `jaxkv.model.params`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from checkpoints.dtypes import resolve_dtype
from checkpoints.hf_config import from_hf_config
from checkpoints.limits import check_layer_count
from checkpoints.moe_tensors import Into, hf_moe_map
from checkpoints.mxfp4 import mxfp4_tensors
from jaxkv.config import ModelConfig
from jaxkv.model.params import check_params, expected_shapes, shape_problems
from jaxkv.tokenizer import MAX_INDEX_BYTES, read_json_file

_ST_DTYPES = ("F64", "F32", "F16", "BF16")  # floating weights jaxkv loads

# HF per-layer name (under "model.layers.{i}.") -> (jaxkv name, transform).
# Transforms: "copy"; "T" ([out, in] -> [in, out]); "q"/"kv" ([n*D, E] -> [E, n, D]);
# "bq"/"bkv" ([n*D] -> [n, D]); "o" ([E, H*D] -> [H, D, E]).
HF_LAYER_MAP = {
    "input_layernorm.weight": ("attn_norm", "copy"),
    "self_attn.q_proj.weight": ("wq", "q"),
    "self_attn.k_proj.weight": ("wk", "kv"),
    "self_attn.v_proj.weight": ("wv", "kv"),
    "self_attn.q_proj.bias": ("bq", "bq"),
    "self_attn.k_proj.bias": ("bk", "bkv"),
    "self_attn.v_proj.bias": ("bv", "bkv"),
    "self_attn.o_proj.weight": ("wo", "o"),
    "self_attn.o_proj.bias": ("bo", "copy"),
    "post_attention_layernorm.weight": ("mlp_norm", "copy"),
    "mlp.gate_proj.weight": ("w_gate", "T"),
    "mlp.up_proj.weight": ("w_up", "T"),
    "mlp.down_proj.weight": ("w_down", "T"),
}
# Gemma's four norms per layer: post_attention_layernorm is the norm of the
# attention's output there (Llama's pre-MLP norm elsewhere).
HF_POST_NORM_MAP = {
    "post_attention_layernorm.weight": ("post_attn_norm", "copy"),
    "pre_feedforward_layernorm.weight": ("mlp_norm", "copy"),
    "post_feedforward_layernorm.weight": ("post_mlp_norm", "copy"),
}
HF_QK_NORM_MAP = {
    "self_attn.q_norm.weight": ("q_norm", "copy"),
    "self_attn.k_norm.weight": ("k_norm", "copy"),
    "self_attn.sinks": ("sinks", "copy"),
    # fp8 KV scales (vLLM / llm-compressor's kv_cache_scheme): [] or [1]
    "self_attn.k_scale": ("k_scale", "scalar"),
    "self_attn.v_scale": ("v_scale", "scalar"),
}
KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale")
HF_TOP_MAP = {
    "model.embed_tokens.weight": ("embed", "copy"),
    "model.norm.weight": ("final_norm", "copy"),
    "lm_head.weight": ("lm_head", "T"),
}


def _hf_shape(how: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF-layout shape of a tensor whose jaxkv shape is ``shape``."""
    if how in ("copy", "scalar"):
        return shape
    if how == "T":
        return shape[::-1]
    if how in ("q", "kv"):  # [E, n, D] <- [n*D, E]
        return (shape[1] * shape[2], shape[0])
    if how in ("bq", "bkv"):  # [n, D] <- [n*D]
        return (shape[0] * shape[1],)
    if how == "o":  # [H, D, E] <- [E, H*D]
        return (shape[2], shape[0] * shape[1])
    raise AssertionError(how)


def hf_tensor_map(
    config: ModelConfig, names: Iterable[str] = ()
) -> dict[str, tuple[str, Any, tuple[int, ...]]]:
    """HF name -> (jaxkv name, transform, expected HF shape) for every tensor the
    model needs. ``lm_head.weight`` is absent for tied embeddings. A sparse
    layer's tensors transform by `checkpoints.moe_tensors.Into` (experts
    stacked), in the layout ``names``, the checkpoint's, holds."""
    want = expected_shapes(config)
    table: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    layer_map = {
        **HF_LAYER_MAP,
        **HF_QK_NORM_MAP,
        **(HF_POST_NORM_MAP if config.post_norms else {}),
    }
    entries = list(HF_TOP_MAP.items()) + [
        (f"model.layers.{i}.{suffix}", (f"layers.{i}.{name}", how))
        for i in range(config.num_layers)
        for suffix, (name, how) in layer_map.items()
    ]
    for hf, (name, how) in entries:
        if name in want:  # skips lm_head when tied and biases when absent
            table[hf] = (name, how, _hf_shape(how, want[name]))
    table.update(hf_moe_map(config, names))
    return table


def _transform(how: str, w: np.ndarray, config: ModelConfig) -> np.ndarray:
    D, E = config.head_dim, config.hidden_size
    if how == "copy":
        return w
    if how == "scalar":  # [1] or []
        return w.reshape(())
    if how == "T":
        return w.T
    if how in ("q", "kv"):  # [n*D, E] -> [E, n, D]
        return w.T.reshape(E, -1, D)
    if how in ("bq", "bkv"):  # [n*D] -> [n, D]
        return w.reshape(-1, D)
    if how == "o":  # [E, H*D] -> [H, D, E]
        return w.T.reshape(-1, D, E)
    raise AssertionError(how)


def hf_to_params(
    config: ModelConfig,
    tensors: Mapping[str, Callable[[], np.ndarray]],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    dtype: str | np.dtype | None = "float32",
    source: str = "checkpoint",
    progress: bool = False,
    layers_field: str = "num_hidden_layers",
    kept: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Map HF-named tensors to jaxkv params.

    ``tensors`` maps HF name -> zero-argument loader of the array in HF layout;
    ``shapes`` gives each tensor's stored shape (checked before loading);
    ``kept`` (HF name -> object with the param's ``shape``) stands for a
    tensor as it is, never loaded (a GGUF's blocks, `jaxkv.model.blocks`).
    Raises ValueError naming missing, unexpected and wrong-shape tensors, and
    first ``layers_field`` (the source's name for the layer count) when
    ``config.num_layers`` is not the number of layers whose tensors exist.
    """
    dt = resolve_dtype(dtype)
    try:
        check_layer_count(config.num_layers, tensors, "model.layers.", layers_field)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    names = {n for n in tensors if not n.endswith("rotary_emb.inv_freq")}
    table, want = hf_tensor_map(config, names), expected_shapes(config)
    if config.tie_word_embeddings and "lm_head.weight" in names:
        names.discard("lm_head.weight")  # a tied copy of the embedding, dropped
    stored = {
        n: (() if n.endswith(KV_SCALE_SUFFIXES) and tuple(shapes[n]) == (1,) else shapes[n])
        for n in names
    }
    problems = shape_problems({n: t[2] for n, t in table.items()}, stored)
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems))
    params = {}
    for hf in tqdm(
        sorted(table), desc="loading tensors", disable=None if progress else True, unit="tensor"
    ):
        name, how, _ = table[hf]
        if kept and hf in kept:
            params[name] = kept[hf]
            continue
        if isinstance(how, Into):  # a sparse layer's tensor, maybe one expert of a stack
            how.put(params, name, np.asarray(tensors[hf]()), want[name], dt)
            continue
        w = _transform(how, np.asarray(tensors[hf]()), config)
        # Always a fresh C-order copy: sources may be memory-mapped files.
        params[name] = np.empty(w.shape, dt)
        np.copyto(params[name], w, casting="unsafe")
    check_params(config, params)
    return params


def open_safetensors(
    path: str | os.PathLike,
) -> dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]:
    """name -> (shape, loader) for each tensor of one safetensors file, read
    with the `safetensors` library (it validates the header, and that the
    tensors' data offsets are in range, contiguous and do not overlap).
    Raises ValueError naming the file when it is truncated or corrupt, or a
    tensor has a dtype jaxkv does not load (uint8 only as MXFP4 ``*_blocks``
    / ``*_scales``, `checkpoints.mxfp4`)."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="numpy") as f:
            info = {
                name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                for name in f.keys()
            }
    except SafetensorError as e:
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read safetensors file ({e})") from None
    for name, (_, dtype) in info.items():
        if dtype not in _ST_DTYPES and not (
            dtype == "U8" and name.endswith(("_blocks", "_scales"))
        ):
            raise ValueError(
                f"{path}: tensor {name!r} has unsupported dtype {dtype} (supported: {_ST_DTYPES})"
            )

    def loader(name):
        def load() -> np.ndarray:
            try:
                with safe_open(str(path), framework="numpy") as f:
                    return f.get_tensor(name)
            except SafetensorError as e:
                raise ValueError(f"{path}: cannot read tensor {name!r} ({e})") from None

        return load

    return {name: (shape, loader(name)) for name, (shape, _) in info.items()}


def _shard_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    index = path / "model.safetensors.index.json"
    if os.path.lexists(index):  # a dangling link or a non-regular file is an error, not "absent"
        try:
            weight_map = read_json_file(index, MAX_INDEX_BYTES)["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
            ):
                raise TypeError("weight_map is not a {tensor: file} object")
        except (KeyError, TypeError) as e:
            raise ValueError(f"{index}: corrupt index file ({type(e).__name__}: {e})") from None
        files = sorted(set(weight_map.values()))
        for f in files:
            if os.path.basename(f) != f or not (path / f).is_file():
                raise ValueError(f"{index}: corrupt index file (shard {f!r} does not exist)")
        return [path / f for f in files], weight_map
    single = path / "model.safetensors"
    if single.is_file():
        return [single], None
    raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")


def load_hf_tensors(
    path: str | os.PathLike,
) -> dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]]:
    """All tensors of an HF dir, as name -> (shape, loader); checks the index."""
    path = Path(path)
    files, weight_map = _shard_files(path)
    tensors: dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]] = {}
    for f in files:
        for name, entry in open_safetensors(f).items():
            if name in tensors:
                raise ValueError(f"{f}: tensor {name!r} also appears in another shard")
            if weight_map is not None and weight_map.get(name) != f.name:
                raise ValueError(
                    f"{path / 'model.safetensors.index.json'}: corrupt index file "
                    f"(tensor {name!r} is in {f.name}, index says {weight_map.get(name)!r})"
                )
            tensors[name] = entry
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise ValueError(
                f"{path / 'model.safetensors.index.json'}: corrupt index file "
                f"(tensors {absent[:5]} not found in their shards)"
            )
    return tensors


# A multimodal checkpoint's language model under its own prefix
# (transformers 5, then 4.x), and the parts of it a text decoder leaves out.
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_NOT_TEXT = (
    "model.vision_tower.",
    "vision_tower.",
    "model.multi_modal_projector.",
    "multi_modal_projector.",
)


def text_tensors(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The tensors of the text decoder under the plain names
    (``model.layers.0...``): a multimodal checkpoint's (Gemma 3) language
    model renamed and its vision tower and projector dropped; any other
    checkpoint as it is."""
    if not any(n.startswith(p) for n in tensors for p, _ in _TEXT_PREFIXES):
        return dict(tensors)
    out = {}
    for name, t in tensors.items():
        if name.startswith(_NOT_TEXT):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = t
    return out


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """ModelConfig from ``path/config.json`` (a regular file of at most
    `jaxkv.tokenizer.MAX_CONFIG_BYTES`)."""
    cfg_path = Path(path) / "config.json"
    cfg = read_json_file(cfg_path)
    try:
        return from_hf_config(cfg)
    except ValueError as e:
        raise ValueError(f"{cfg_path}: {e}") from None


def load_hf_dir(
    path: str | os.PathLike, *, dtype: str | np.dtype | None = "float32", progress: bool = False
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Load an HF model dir (config.json + safetensors) into (config, params)."""
    config = read_hf_config(path)
    tensors = mxfp4_tensors(text_tensors(load_hf_tensors(path)), str(path))  # MXFP4 experts: float
    if any(n.endswith(KV_SCALE_SUFFIXES) for n in tensors):  # the fp8 KV scales it carries
        config = dataclasses.replace(config, kv_cache_scales=True)
    params = hf_to_params(
        config,
        {n: t[1] for n, t in tensors.items()},
        {n: t[0] for n, t in tensors.items()},
        dtype=dtype,
        source=str(path),
        progress=progress,
    )
    return config, params
