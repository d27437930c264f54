"""The hostile checkpoints of the checkpoint probe (scripts/probe/checkpoint_files.py):
writers of a tiny llama as a Hugging Face folder, a GGUF file and a jaxkv
checkpoint, the edits that break each in one way, and the case tables built
from them: CASES (case -> (builder under a dir, regex the converter's error
must match)) and CONTROLS (case -> builder of a good source)."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

V, E, F, L, H, K = 64, 16, 24, 2, 4, 2
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": V,
    "hidden_size": E,
    "intermediate_size": F,
    "num_hidden_layers": L,
    "num_attention_heads": H,
    "num_key_value_heads": K,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
GGUF_META = {
    "block_count": L,
    "embedding_length": E,
    "feed_forward_length": F,
    "attention.head_count": H,
    "attention.head_count_kv": K,
    "context_length": 128,
}


def _config():
    from jaxkv.config import ModelConfig

    return ModelConfig(
        architecture="llama",
        vocab_size=V,
        hidden_size=E,
        intermediate_size=F,
        num_layers=L,
        num_heads=H,
        num_kv_heads=K,
        head_dim=E // H,
        bos_token_id=1,
        eos_token_ids=(2,),
    )


def hf_tensors() -> dict[str, np.ndarray]:
    """Random float32 weights of the tiny llama, in HF names and layout."""
    from checkpoints.safetensors_io import hf_tensor_map

    rng = np.random.default_rng(0)
    return {
        n: rng.standard_normal(t[2]).astype(np.float32) for n, t in hf_tensor_map(_config()).items()
    }


def write_tokenizer(path: Path, vocab_size: int = V) -> None:
    """A word-level tokenizer.json + tokenizer_config.json of `vocab_size` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )


def write_hf(path: Path, tensors: dict[str, np.ndarray] | None = None, **config) -> Path:
    """config.json (HF_CONFIG with `config` over it), model.safetensors, a tokenizer."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**HF_CONFIG, **config}))
    save_file(hf_tensors() if tensors is None else tensors, str(path / "model.safetensors"))
    write_tokenizer(path)
    return path


def write_gguf(path: Path, n_tokens: int = V, **meta) -> Path:
    """A float32 GGUF llama file; `meta` overrides llama.* keys."""
    from gguf import GGUFWriter

    from checkpoints.gguf_io import GGUF_LAYER_MAP, GGUF_TOP_MAP

    to_gguf = {hf: g for g, hf in GGUF_TOP_MAP.items()}
    to_gguf |= {
        f"model.layers.{i}.{hf}": f"blk.{i}.{g}"
        for i in range(L)
        for g, hf in GGUF_LAYER_MAP.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), "llama")
    for key, value in {**GGUF_META, **meta}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(n_tokens)])
    w.add_array("tokenizer.ggml.merges", [])
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, x in hf_tensors().items():
        w.add_tensor(to_gguf[name], x)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return path


def write_jaxkv(path: Path) -> Path:
    """A jaxkv checkpoint of the tiny llama (no tokenizer)."""
    from checkpoints.jaxkv_format import save
    from jaxkv.model.params import expected_shapes

    rng = np.random.default_rng(0)
    params = {
        k: rng.standard_normal(s).astype(np.float32) for k, s in expected_shapes(_config()).items()
    }
    return save(path, _config(), params)


def edit_json(path: Path, edit: Callable[[dict], object]) -> Path:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def st_header(path: Path, edit: Callable[[dict], object]) -> None:
    """Rewrite model.safetensors' JSON header through `edit`, data unchanged."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def truncate(path: Path, keep: float) -> Path:
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    return path


def patch_gguf_dims(path: Path, tensor: str, dims: list[int]) -> Path:
    """Overwrite a tensor's dims in the GGUF tensor-info table (same n_dims)."""
    raw = bytearray(path.read_bytes())
    name = tensor.encode()
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    assert n_dims == len(dims), (n_dims, dims)
    struct.pack_into(f"<{n_dims}Q", raw, at + 4, *dims)
    path.write_bytes(bytes(raw))
    return path


def flip_tensor_byte(ck: Path) -> Path:
    """Flip one bit in the largest data file under params/ (compressed by
    orbax, so positions are tried): keep the first flip after which the data
    restores changed (only the checksums can see it), else one that breaks
    decoding; at most 16 tries, flips that change nothing are undone."""
    from checkpoints.jaxkv_format import restore

    _, want, _ = restore(ck, verify_checksums=False)
    data = max(
        (f for f in (ck / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size
    )
    original, fallback = data.read_bytes(), None
    for pos in np.linspace(len(original) // 8, len(original) - 8, 16).astype(int):
        flipped = bytearray(original)
        flipped[pos] ^= 1 << (pos % 8)
        data.write_bytes(bytes(flipped))
        try:
            _, got, _ = restore(ck, verify_checksums=False)
        except ValueError:
            fallback = fallback or bytes(flipped)
            continue
        if any(not np.array_equal(got[k], want[k]) for k in want):
            return ck
    if fallback is None:
        raise RuntimeError(f"no flip in {data.name} changed or broke the data")
    data.write_bytes(fallback)
    return ck


def _hf(**config):
    return lambda d: write_hf(d / "hf", **config)


def _then(write: Callable[[Path], Path], name: str, edit: Callable[[Path], object], **kw):
    """A builder: `write` the checkpoint at d / name, then `edit` it."""

    def make(d: Path) -> Path:
        p = write(d / name, **kw)
        edit(p)
        return p

    return make


def _hf_then(edit: Callable[[Path], object]):
    return _then(write_hf, "hf", edit)


def _hf_tensors(edit: Callable[[dict], object]):
    def make(d: Path) -> Path:
        t = hf_tensors()
        edit(t)
        return write_hf(d / "hf", tensors=t)

    return make


def _gguf_then(edit: Callable[[Path], object], **meta):
    return _then(write_gguf, "m.gguf", edit, **meta)


def _jaxkv_then(edit: Callable[[Path], object]):
    return _then(write_jaxkv, "ck", edit)


def _replace(name: str, how: str):
    """Replace a side file by a link to /dev/zero or by a FIFO."""

    def edit(p: Path) -> None:
        (p / name).unlink(missing_ok=True)
        (p / name).symlink_to("/dev/zero") if how == "zero" else os.mkfifo(p / name)

    return edit


def _write(name: str, text: str):
    return lambda p: (p / name).write_text(text)


def _neither(d: Path) -> Path:
    (d / "junk").mkdir()
    (d / "junk" / "README.txt").write_text("not a model\n")
    return d / "junk"


def _drop(key: str):
    return lambda t: t.pop(key)


NAME = "model.safetensors"
CASES: dict[
    str, tuple[Callable[[Path], Path], str]
] = {  # case -> (builder under a dir, regex of the error)
    # safetensors files
    "st_truncated": (_hf_then(lambda p: truncate(p / NAME, 0.6)), rf"{NAME}.*(truncat|corrupt)"),
    "st_offset_lie": (
        _hf_then(
            lambda p: st_header(
                p / NAME, lambda h: h["model.norm.weight"].__setitem__("data_offsets", [0, 1 << 40])
            )
        ),
        rf"{NAME}.*(corrupt|offset)",
    ),
    "st_dtype_lie": (
        _hf_then(
            lambda p: st_header(
                p / NAME, lambda h: h["model.norm.weight"].__setitem__("dtype", "F64")
            )
        ),
        rf"{NAME}.*(corrupt|dtype)",
    ),
    "st_int_dtype": (
        _hf_then(
            lambda p: st_header(
                p / NAME, lambda h: h["model.norm.weight"].__setitem__("dtype", "I32")
            )
        ),
        r"model\.norm\.weight.*I32",
    ),
    "st_shape_lie": (
        _hf_then(
            lambda p: st_header(
                p / NAME, lambda h: h["model.norm.weight"].__setitem__("shape", [E * 1000])
            )
        ),
        rf"{NAME}.*(corrupt|shape)",
    ),
    "st_header_2e60": (
        _hf_then(
            lambda p: (p / NAME).write_bytes(
                struct.pack("<Q", 1 << 60) + (p / NAME).read_bytes()[8:]
            )
        ),
        rf"{NAME}.*(corrupt|header|large)",
    ),
    "st_missing_tensor": (
        _hf_tensors(_drop("model.layers.1.mlp.up_proj.weight")),
        r"layers\.1\.mlp\.up_proj",
    ),
    "st_missing_layer": (
        _hf_tensors(lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.")]),
        r"num_hidden_layers",
    ),
    "st_extra_tensor": (
        _hf_tensors(lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(4, "f4")})),
        r"model\.layers\.0\.mlp\.extra\.weight",
    ),  # documented: unexpected tensors raise
    "st_wrong_shape": (
        _hf_tensors(lambda t: t.update({"model.embed_tokens.weight": np.zeros((V, E + 1), "f4")})),
        r"embed_tokens",
    ),
    # config.json values
    "cfg_hidden_nan": (_hf(hidden_size=math.nan), r"hidden_size"),
    "cfg_eps_inf": (_hf(rms_norm_eps=math.inf), r"rms_norm_eps"),
    "cfg_layers_1e9": (_hf(num_hidden_layers=10**9), r"num_hidden_layers.*1000000000"),
    "cfg_hidden_indivisible": (_hf(hidden_size=E + 2), r"hidden_size|num_attention_heads|head_dim"),
    "cfg_heads_negative": (_hf(num_attention_heads=-4), r"num_attention_heads"),
    "cfg_kv_heads_zero": (_hf(num_key_value_heads=0), r"num_key_value_heads"),
    "cfg_kv_heads_indivisible": (
        _hf(num_key_value_heads=3),
        r"num_key_value_heads|num_attention_heads",
    ),
    "cfg_vocab_zero": (_hf(vocab_size=0), r"vocab_size"),
    "cfg_rope_theta_zero": (_hf(rope_theta=0), r"rope_theta"),
    "cfg_rope_theta_negative": (_hf(rope_theta=-10000.0), r"rope_theta"),
    "cfg_rope_theta_string": (_hf(rope_theta="10000"), r"rope_theta"),
    "cfg_rope_scaling_unknown": (
        _hf(rope_scaling={"rope_type": "warp9", "factor": 2.0}),
        r"rope_scaling",
    ),
    "cfg_unknown_arch": (
        _hf(architectures=["FooForCausalLM"], model_type="foo"),
        r"architectures|model_type",
    ),
    "cfg_not_json": (_hf_then(_write("config.json", "{vocab_size: 64,")), r"config\.json"),
    "cfg_a_list": (_hf_then(_write("config.json", json.dumps([HF_CONFIG]))), r"config\.json"),
    "cfg_deep": (_hf_then(_write("config.json", "[" * 10**6 + "]" * 10**6)), r"config\.json"),
    "cfg_fifo": (
        _hf_then(_replace("config.json", "fifo")),
        r"config\.json.*(not a regular file|FIFO|fifo)",
    ),
    "tokenizer_dev_zero": (_hf_then(_replace("tokenizer.json", "zero")), r"tokenizer\.json"),
    # GGUF files
    "gguf_bad_magic": (
        _gguf_then(lambda p: p.write_bytes(b"GGUX" + p.read_bytes()[4:])),
        r"m\.gguf.*(magic|GGUF)",
    ),
    "gguf_truncated": (_gguf_then(lambda p: truncate(p, 0.7)), r"m\.gguf.*(truncat|corrupt)"),
    "gguf_block_count_1e9": (
        _gguf_then(lambda p: p, block_count=10**9),
        r"block_count.*1000000000",
    ),
    "gguf_dims_overflow": (
        _gguf_then(lambda p: patch_gguf_dims(p, "token_embd.weight", [1 << 32, 1 << 32])),
        r"m\.gguf.*(corrupt|token_embd)",
    ),  # named by file
    "gguf_tokens_over_vocab": (
        lambda d: write_gguf(d / "m.gguf", n_tokens=2 * V),
        r"tokenizer.*128.*64|vocab",
    ),
    # jaxkv checkpoints
    "jaxkv_manifest_shape": (
        _jaxkv_then(
            lambda p: edit_json(
                p / "jaxkv_checkpoint.json",
                lambda m: m["tensors"]["embed"].__setitem__(0, [10**6, 10**6]),
            )
        ),
        r"embed",
    ),
    "jaxkv_flipped_byte": (
        _jaxkv_then(flip_tensor_byte),
        r"checksum mismatch|params.*cannot restore",
    ),
    "jaxkv_dtype_lie": (
        _jaxkv_then(
            lambda p: edit_json(
                p / "jaxkv_checkpoint.json",
                lambda m: m["tensors"]["embed"].__setitem__(1, "bfloat16"),
            )
        ),
        r"embed.*bfloat16",
    ),
    "jaxkv_layers_1e9": (
        _jaxkv_then(
            lambda p: edit_json(p / "model_config.json", lambda c: c.update(num_layers=10**9))
        ),
        r"num_layers",
    ),
    # neither format
    "neither_format": (_neither, r"junk.*neither"),
    "no_such_path": (lambda d: d / "does-not-exist", r"does-not-exist.*no such"),
}
CONTROLS: dict[str, Callable[[Path], Path]] = {
    "control_hf": lambda d: write_hf(d / "hf"),
    "control_gguf": lambda d: write_gguf(d / "m.gguf"),
    "control_jaxkv": lambda d: write_jaxkv(d / "ck"),
}
