"""GGUF checkpoints (llama.cpp): metadata -> ModelConfig, tensors -> params,
``tokenizer.*`` metadata -> tokenizer_info for `checkpoints.gguf_tokenizer.tokenizer_from_gguf`.

Tensors are dequantized with ``gguf.quants.dequantize`` into HF layout ([out, in]
rows, numpy order = reversed GGUF ``ne``), renamed to HF names through the
explicit table below and then mapped like a safetensors checkpoint.

llama.cpp's converter permutes the rows of the q and k weights of llama-arch
models: within each head it interleaves the two "rotate_half" halves, so HF
rows (c * D/2 + i) land at GGUF rows (2 * i + c). `unpermute_qk` undoes that.
qwen2, qwen3 and gemma files are not permuted. Gemma's norm weights are
stored as 1 + w (llama.cpp's converter adds the 1 that HF's Gemma RMSNorm
adds at run time); loading subtracts it, so every source gives HF's w.
"""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from checkpoints.gguf_config import from_gguf_metadata
from checkpoints.safetensors_io import hf_to_params
from jaxkv.config import ModelConfig

GGUF_MAGIC = b"GGUF"
SUPPORTED_TYPES = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
}
# Architectures whose q/k rows llama.cpp's converter permutes.
PERMUTED_ARCHS = {"llama", "mistral"}

# GGUF name -> HF name; per layer under "blk.{i}." / "model.layers.{i}.".
GGUF_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Gemma's four norms: llama.cpp's ffn_norm is the pre-MLP norm, and its
# post_attention_norm the norm of the attention's output (HF's
# post_attention_layernorm there; Llama's pre-MLP norm elsewhere).
GGUF_GEMMA_LAYER_MAP = {
    **GGUF_LAYER_MAP,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# llama.cpp's converter stores Gemma norms as 1 + w; loading subtracts it.
NORM_SHIFTED_ARCHS = {"gemma2", "gemma3"}
GGUF_TOP_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def is_gguf(path: str | os.PathLike) -> bool:
    """True for a file ending in .gguf or starting with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with open(p, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """HF name for a GGUF tensor name of architecture `arch`, None when the
    table has no entry."""
    if name in GGUF_TOP_MAP:
        return GGUF_TOP_MAP[name]
    table = GGUF_GEMMA_LAYER_MAP if arch in NORM_SHIFTED_ARCHS else GGUF_LAYER_MAP
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}"
    return None


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: [n*D, E] interleaved -> HF halves."""
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_file(path: Path) -> None:
    """A regular file (a FIFO would block the reader, a device never end)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ValueError(f"{path}: cannot open ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: not a regular file; refusing to read it")


def _open(path: Path) -> GGUFReader:
    _check_file(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}")
        return GGUFReader(path)
    except (
        ValueError,
        KeyError,
        IndexError,
        TypeError,
        struct.error,
        OverflowError,
        UnicodeDecodeError,
        MemoryError,
    ) as e:
        raise ValueError(
            f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})"
        ) from None


def read_metadata(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """All key/values of the file, decoded to Python values."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt GGUF metadata {key!r} ({e})") from None
    return meta


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Only the key/values of a GGUF file (e.g. for its tokenizer)."""
    return _parsed(Path(path))[0]


def _parsed(path: Path) -> tuple[dict[str, Any], list]:
    """(the key/values, the tensors) of a GGUF file: from its index in the
    cache when a start parsed it before (`checkpoints.gguf_index`), else
    parsed by the gguf library's reader (and indexed for next time)."""
    from checkpoints.gguf_index import load as load_index
    from checkpoints.gguf_index import save as save_index

    _check_file(path)
    indexed = load_index(path)
    if indexed is not None:
        return indexed
    reader = _open(path)
    meta = read_metadata(reader, path)
    save_index(path, meta, reader.tensors)
    return meta, list(reader.tensors)


def load_gguf(
    path: str | os.PathLike,
    *,
    dtype: str | np.dtype | None = "float32",
    progress: bool = False,
    keep_blocks: bool = False,
) -> tuple[ModelConfig, dict[str, np.ndarray], dict[str, Any]]:
    """Load a GGUF file into (config, params, tokenizer_info). With
    `keep_blocks`, a Q8_0 tied embedding stays as its blocks
    (params["embed"] a `jaxkv.model.q8.Q8Blocks`), and so do the layers'
    matmul weights of the types `jaxkv.model.blocks` reads (each a
    `BlockWeight`).

    tokenizer_info holds every ``tokenizer.*`` key of the file (tokens, merges,
    token types, bos/eos ids, add_bos_token, pre-tokenizer, chat_template)."""
    path = Path(path)
    meta, found = _parsed(path)
    size = path.stat().st_size
    tensors = {}
    for t in found:
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name!r} has unsupported type {t.tensor_type.name} "
                f"(supported: {sorted(q.name for q in SUPPORTED_TYPES)})"
            )
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        if t.n_elements % block or (len(t.shape) and int(t.shape[0]) % block):
            raise ValueError(
                f"{path}: corrupt GGUF file (tensor {t.name!r} shape {t.shape.tolist()} "
                f"is not a multiple of the {t.tensor_type.name} block size {block})"
            )
        nbytes = t.n_elements // block * type_size
        if t.data_offset + nbytes > size or t.data.nbytes != nbytes:
            raise ValueError(
                f"{path}: truncated GGUF file (tensor {t.name!r} needs {nbytes} bytes "
                f"at offset {t.data_offset}, file has {size})"
            )
        tensors[t.name] = t
    embed = tensors.get("token_embd.weight")
    try:
        config = from_gguf_metadata(
            meta,
            vocab_size=int(embed.shape[-1]) if embed is not None else None,
            tied="output.weight" not in tensors,
        )
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: bad GGUF metadata: {e}") from None

    hf_tensors: dict[str, Callable[[], np.ndarray]] = {}
    hf_shapes: dict[str, tuple[int, ...]] = {}
    unknown = []
    arch = meta["general.architecture"]
    for name, t in tensors.items():
        hf = gguf_to_hf_name(name, arch)
        if hf is None:
            unknown.append(name)
            continue
        heads = None
        if arch in PERMUTED_ARCHS:
            if name.endswith("attn_q.weight"):
                heads = config.num_heads
            elif name.endswith("attn_k.weight"):
                heads = config.num_kv_heads
        shift = arch in NORM_SHIFTED_ARCHS and name.endswith("norm.weight")
        hf_shapes[hf] = tuple(int(s) for s in reversed(t.shape.tolist()))
        hf_tensors[hf] = _loader(t, hf_shapes[hf], heads, path, shift)
    if unknown:
        raise ValueError(f"{path}: unexpected tensors {sorted(unknown)}")
    kept = _kept_blocks(config, tensors, hf_shapes, arch) if keep_blocks else {}
    params = hf_to_params(
        config,
        hf_tensors,
        hf_shapes,
        dtype=dtype,
        source=str(path),
        progress=progress,
        layers_field=f"{meta['general.architecture']}.block_count",
        kept=kept,
    )
    tokenizer_info = {k: v for k, v in meta.items() if k.startswith("tokenizer.")}
    return config, params, tokenizer_info


def _kept_blocks(config: ModelConfig, tensors, hf_shapes, arch: str) -> dict[str, Any]:
    """HF name -> the raw blocks standing for that tensor (never dequantized):
    each layer matmul weight the native block matmul reads (a type of
    `jaxkv.model.blocks.TYPES` in rows of whole blocks: `readable`; q/k rows
    put back in HF order for llama), and a tied Q8_0 embedding."""
    from checkpoints.safetensors_io import hf_tensor_map
    from jaxkv.model.blocks import BlockWeight, readable
    from jaxkv.model.params import expected_shapes
    from jaxkv.model.q8 import Q8Blocks

    table, want = hf_tensor_map(config), expected_shapes(config)
    kept: dict[str, Any] = {}
    for name, t in tensors.items():
        hf = gguf_to_hf_name(name, arch)
        if hf not in table or hf_shapes.get(hf) != table[hf][2]:
            continue  # hf_to_params names the problem
        if (
            name == "token_embd.weight"
            and config.tie_word_embeddings
            and t.tensor_type == GGMLQuantizationType.Q8_0
        ):
            kept[hf] = Q8Blocks(t.data, hf_shapes[hf])
        elif (
            name.startswith("blk.")
            and len(t.shape) == 2
            and readable(t.tensor_type, int(t.shape[0]))
        ):
            cols, rows = (int(s) for s in t.shape)
            raw = np.ascontiguousarray(t.data, np.uint8).reshape(rows, -1)
            if arch in PERMUTED_ARCHS and name.endswith(("attn_q.weight", "attn_k.weight")):
                raw = unpermute_qk(
                    raw, config.num_heads if "attn_q" in name else config.num_kv_heads
                )
            kept[hf] = BlockWeight(raw, t.tensor_type, rows, cols, want[table[hf][0]])
    return kept


def _loader(
    t, shape: tuple[int, ...], heads: int | None, path: Path, shift: bool = False
) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        except (ValueError, IndexError) as e:
            raise ValueError(f"{path}: corrupt GGUF tensor {t.name!r} ({e})") from None
        if shift:  # stored as 1 + w (Gemma): back to HF's w
            w = w - np.float32(1.0)
        if heads is not None:
            if shape[0] % heads or (shape[0] // heads) % 2:
                raise ValueError(
                    f"{path}: tensor {t.name!r} rows {shape[0]} do not split into "
                    f"{heads} heads of even size"
                )
            w = unpermute_qk(w, heads)
        return w

    return load
