"""Hostile LoRA adapter folders for a base model of `config`, one way to
break each, and the words the refusal must carry: what a client may point
`/v1/load_lora_adapter` (or `--lora-modules`, or `LLM.generate`'s
`lora_request`) at. Shared by the probe (scripts/probe/__main__.py) and the tests.

    hostile_adapters(root, config) -> {case: (folder, words)}
    good_adapter(root, config, name, rank=1, seed=0) -> folder
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

KEY = "base_model.model.model.layers.{l}.self_attn.{m}.lora_{ab}.weight"
LORA = {"peft_type": "LORA", "r": 1, "lora_alpha": 2, "target_modules": ["q_proj", "v_proj"]}


def _factors(config, rank: int, seed: int, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    E, H, K, D = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    out = {}
    for layer in range(config.num_layers):
        for m, n_out in (("q_proj", H * D), ("v_proj", K * D)):
            out[KEY.format(l=layer, m=m, ab="A")] = (0.1 * rng.standard_normal((rank, E))).astype(
                dtype
            )
            out[KEY.format(l=layer, m=m, ab="B")] = (
                0.1 * rng.standard_normal((n_out, rank))
            ).astype(dtype)
    return out


def _folder(root: Path, name: str, cfg=LORA, tensors=None) -> Path:
    from safetensors.numpy import save_file

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        (d / "adapter_config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    if tensors is not None:
        save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def good_adapter(root: Path, config, name: str, rank: int = 1, seed: int = 0, **cfg) -> Path:
    """A well-formed rank-`rank` adapter of q_proj and v_proj."""
    return _folder(Path(root), name, {**LORA, "r": rank, **cfg}, _factors(config, rank, seed))


def hostile_adapters(root: Path, config) -> dict[str, tuple[Path, str]]:
    """case -> (adapter folder, a word its refusal must carry)."""
    root = Path(root)
    good = _factors(config, 1, 0)
    a0, b0 = KEY.format(l=0, m="q_proj", ab="A"), KEY.format(l=0, m="q_proj", ab="B")
    E = config.hidden_size
    cases: dict[str, tuple[Path, str]] = {}

    def case(name, words, cfg=LORA, tensors=good):
        cases[name] = (_folder(root, name, cfg, tensors), words)

    case("config_is_a_list", "not an object", "[1, 2, 3]")
    case("config_is_a_string", "not an object", '"LORA"')
    case("alpha_is_a_string", "lora_alpha", {**LORA, "lora_alpha": "x"})
    case("targets_an_integer", "target_modules", {**LORA, "target_modules": 7})
    case("deep_json", "adapter_config.json", "[" * 100_000 + "]" * 100_000)
    case("broken_json", "adapter_config.json", '{"peft_type": "LORA",')
    case("backtracking_alpha_pattern", "alpha_pattern", {**LORA, "alpha_pattern": {"(.+)+Z": 1}})
    case(
        "backtracking_rank_pattern", "rank_pattern", {**LORA, "rank_pattern": {r"model\.(.+)+Z": 1}}
    )
    case("alpha_1e308", "scale", {**LORA, "lora_alpha": 1e308})
    case("nan_weights", "NaN", tensors={**good, a0: np.full_like(good[a0], np.nan)})
    case("zero_d_tensor", "shape", tensors={**good, a0: np.array(1.0, np.float32)})
    case(
        "rank_zero",
        "rank 0",
        tensors={
            **good,
            a0: np.zeros((0, E), np.float32),
            b0: np.zeros((good[b0].shape[0], 0), np.float32),
        },
    )
    case("int_tensor", "F16, BF16, F32 or F64", tensors={**good, a0: good[a0].astype(np.int32)})
    d = _folder(root, "garbage_safetensors")
    (d / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!" * 10)
    cases["garbage_safetensors"] = (d, "safetensors")
    d = _folder(root, "huge_header")  # a 600 MB header, in a sparse file
    with open(d / "adapter_model.safetensors", "wb") as f:
        f.write((600 << 20).to_bytes(8, "little") + b'{"')
        f.truncate(8 + (600 << 20))
    cases["huge_header"] = (d, "header")
    d = _folder(
        root, "many_tensors", tensors={f"t{i}": np.zeros(1, np.float32) for i in range(5000)}
    )
    cases["many_tensors"] = (d, "tensors")
    # A 1 GiB factor in a sparse file: refused from its header, never read.
    d = _folder(root, "sparse_gigabyte")
    _sparse_safetensors(d / "adapter_model.safetensors", a0, (1, 1 << 28))
    cases["sparse_gigabyte"] = (d, "does not fit")
    for name, make, words in (
        ("config_fifo", os.mkfifo, "not a regular file"),
        ("config_dir", os.mkdir, "not a regular file"),
        ("config_dev_zero", lambda p: os.symlink("/dev/zero", p), "not a regular file"),
    ):
        d = _folder(root, name, None, good)
        make(str(d / "adapter_config.json"))
        cases[name] = (d, words)
    d = _folder(root, "weights_proc_mem")
    os.symlink("/proc/self/mem", d / "adapter_model.safetensors")
    cases["weights_proc_mem"] = (d, "adapter_model.safetensors")
    d = _folder(root, "weights_fifo")
    os.mkfifo(d / "adapter_model.safetensors")
    cases["weights_fifo"] = (d, "not a regular file")
    cases["missing_folder"] = (root / "no_such_folder", "not found")
    cases["a_file_not_a_folder"] = (
        root / "config_is_a_list" / "adapter_config.json",
        "not a folder",
    )
    return cases


def _sparse_safetensors(path: Path, name: str, shape: tuple[int, int]) -> None:
    """A safetensors file whose one float32 tensor `shape` is a hole."""
    n = 4 * shape[0] * shape[1]
    header = json.dumps({name: {"dtype": "F32", "shape": list(shape), "data_offsets": [0, n]}})
    header += " " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header.encode())
        f.truncate(8 + len(header) + n)
