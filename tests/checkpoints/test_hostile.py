"""Hostile and corrupt checkpoints (issue 34) are refused by name, fast and in
bounded memory: layer counts and shapes no tensors back, side files that are
endless devices or FIFOs, flipped bits (jaxkv checksums), manifest dtypes
that lie, present but invalid config values, tokenizers larger than the
vocabulary; `convert` answers each with one line. Loads that could hang or
grow without bound run in one child process (2 GiB of address space, an
alarm per case, a timeout overall): a regression fails, it does not stall."""

import hashlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from gguf import GGUFWriter
from safetensors.numpy import save_file

from checkpoints import load_checkpoint
from checkpoints.convert import main as convert_main
from checkpoints.gguf_config import from_gguf_metadata
from checkpoints.gguf_tokenizer import tokenizer_from_gguf
from checkpoints.hf_config import from_hf_config
from checkpoints.jaxkv_format import restore, save
from checkpoints.safetensors_io import hf_tensor_map
from jaxkv.config import ModelConfig
from jaxkv.entrypoints.cli import main as cli_main
from jaxkv.model.params import expected_shapes
from tests.helpers.model_utils import save_tiny_tokenizer

V, E, F, L, H, K, D = 64, 16, 24, 2, 4, 2, 4
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": V,
    "hidden_size": E,
    "intermediate_size": F,
    "num_hidden_layers": L,
    "num_attention_heads": H,
    "num_key_value_heads": K,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=V,
    hidden_size=E,
    intermediate_size=F,
    num_layers=L,
    num_heads=H,
    num_kv_heads=K,
    head_dim=D,
)
GGUF_META = {
    "block_count": L,
    "embedding_length": E,
    "feed_forward_length": F,
    "attention.head_count": H,
    "attention.head_count_kv": K,
    "context_length": 128,
}


def hf_tensors() -> dict[str, np.ndarray]:
    """Random float32 weights of the tiny llama, in HF names and layout."""
    rng = np.random.default_rng(0)
    return {
        n: rng.standard_normal(t[2]).astype(np.float32) for n, t in hf_tensor_map(CONFIG).items()
    }


def write_hf(path: Path, tokenizer_vocab: int | None = V, **config) -> Path:
    """config.json (HF_CONFIG, `config` over it), model.safetensors, a tokenizer."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**HF_CONFIG, **config}))
    save_file(hf_tensors(), str(path / "model.safetensors"))
    if tokenizer_vocab:
        save_tiny_tokenizer(path, tokenizer_vocab)
    return path


def write_gguf(path: Path, **meta) -> Path:
    """A float32 GGUF file of the tiny llama; `meta` overrides llama.* keys."""
    from checkpoints.gguf_io import GGUF_LAYER_MAP, GGUF_TOP_MAP

    to_gguf = {hf: g for g, hf in GGUF_TOP_MAP.items()}
    to_gguf |= {
        f"model.layers.{i}.{hf}": f"blk.{i}.{g}"
        for i in range(L)
        for g, hf in GGUF_LAYER_MAP.items()
    }
    w = GGUFWriter(str(path), "llama")
    for key, value in {**GGUF_META, **meta}.items():
        add = w.add_array if isinstance(value, list) else w.add_uint32
        add(f"llama.{key}", value)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(V)])
    for name, x in hf_tensors().items():
        w.add_tensor(to_gguf[name], x)
    for write in (
        w.write_header_to_file,
        w.write_kv_data_to_file,
        w.write_tensors_to_file,
        w.close,
    ):
        write()
    return path


def write_jaxkv(path: Path) -> Path:
    rng = np.random.default_rng(0)
    params = {
        k: rng.standard_normal(s).astype(np.float32) for k, s in expected_shapes(CONFIG).items()
    }
    return save(path, CONFIG, params)


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_the_builders_make_loadable_checkpoints(tmp_path):
    for path in (
        write_hf(tmp_path / "hf"),
        write_gguf(tmp_path / "m.gguf"),
        write_jaxkv(tmp_path / "ck"),
    ):
        config, params, _ = load_checkpoint(path)
        assert config.num_layers == L and len(params) == len(expected_shapes(config))


# ----------------------------------------------- guarded: memory and hangs
CHILD = r"""
import json, resource, signal, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
def alarm(*_):
    raise TimeoutError("no answer in 15 s")
signal.signal(signal.SIGALRM, alarm)
from checkpoints import load_checkpoint
for case, path in json.loads(sys.argv[1]):
    signal.alarm(15)
    try:
        load_checkpoint(path)
        out = "loaded"
    except BaseException as e:
        out = f"{type(e).__name__}: {e}"
    signal.alarm(0)
    print(json.dumps([case, out]), flush=True)
"""

SIDE_FILES = {  # case -> (checkpoint kind, file, replaced by a link to /dev/zero or a FIFO)
    "tokenizer_config_zero": ("hf", "tokenizer_config.json", "zero"),
    "tokenizer_json_zero": ("hf", "tokenizer.json", "zero"),
    "index_zero": ("hf", "model.safetensors.index.json", "zero"),
    "generation_config_fifo": ("hf", "generation_config.json", "fifo"),
    "model_config_fifo": ("jaxkv", "model_config.json", "fifo"),
    "params_fifo": ("jaxkv", "params/_METADATA", "fifo"),
}
GUARDED = {  # case -> what the one-line refusal must say
    "hf_layers": r"num_hidden_layers.*1000000000.*2 ",
    "gguf_layers": r"llama\.block_count.*1000000000.*2 ",
    "jaxkv_layers": r"num_layers.*1000000000.*2 ",
    "manifest_shape": r"embed.*1000000",
    **{
        case: re.escape(Path(f).name) + ".*not a regular file"
        for case, (_, f, _) in SIDE_FILES.items()
    },
}


def _hostile(root: Path, case: str) -> Path:
    """The checkpoint of one GUARDED case, under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    if case == "gguf_layers":
        return write_gguf(root / "m.gguf", block_count=10**9)
    if case == "hf_layers":
        return write_hf(root / "hf", num_hidden_layers=10**9)
    if case in SIDE_FILES:
        kind, name, how = SIDE_FILES[case]
        path = write_hf(root / "hf") if kind == "hf" else write_jaxkv(root / "ck")
        (path / name).unlink(missing_ok=True)
        if how == "zero":
            (path / name).symlink_to("/dev/zero")
        else:
            os.mkfifo(path / name)
        return path
    path = write_jaxkv(root / "ck")
    if case == "jaxkv_layers":
        edit_json(path / "model_config.json", lambda c: c.update(num_layers=10**9))
    else:
        edit_json(
            path / "jaxkv_checkpoint.json",
            lambda m: m["tensors"]["embed"].__setitem__(0, [10**6] * 2),
        )
    return path


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """case -> "ExceptionType: message" (or "loaded") of load_checkpoint on
    each hostile checkpoint, all run in one limited child process."""
    root = tmp_path_factory.mktemp("hostile")
    cases = [(c, str(_hostile(root / c, c))) for c in GUARDED]
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(cases)],
            check=False,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=Path(__file__).resolve().parents[2],
        ).stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return dict(json.loads(line) for line in out.splitlines() if line.startswith("["))


@pytest.mark.parametrize("case", sorted(GUARDED))
def test_hostile_checkpoint_is_refused_by_name(guarded, case):
    got = guarded.get(case, "the child process ended (killed or timed out) before this case")
    assert got.startswith("ValueError: ") and re.search(GUARDED[case], got), got
    assert "\n" not in got


def test_side_file_over_its_size_limit_is_refused(tmp_path):
    path = write_hf(tmp_path / "hf")
    edit_json(path / "tokenizer_config.json", lambda c: c.update(padding="x" * (9 << 20)))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: .*larger than .*MiB"):
        load_checkpoint(path)


# ------------------------------------------------------ jaxkv checksums
def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest()


def test_checksums_are_written_and_no_bit_flip_loads_changed_data(tmp_path):
    path = write_jaxkv(tmp_path / "ck")
    manifest = json.loads((path / "jaxkv_checkpoint.json").read_text())
    _, params, _ = restore(path)
    assert manifest["version"] == 2
    assert {k: v[2] for k, v in manifest["tensors"].items()} == {
        k: _digest(v) for k, v in params.items()
    }
    data = max(
        (f for f in (path / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size
    )
    original = data.read_bytes()
    errors = []
    for pos in np.linspace(len(original) // 8, len(original) - 8, 12).astype(int):
        flipped = bytearray(original)
        flipped[pos] ^= 1 << (pos % 8)
        data.write_bytes(bytes(flipped))
        try:
            _, back, _ = restore(path)
        except ValueError as e:
            errors.append(str(e))
            continue
        for k in params:  # loaded: then the flip hit no tensor's data
            np.testing.assert_array_equal(back[k], params[k], err_msg=f"flip at byte {pos}")
    assert any("checksum mismatch" in m for m in errors), (
        errors
    )  # decodable flips: only the sums see them


def test_changed_tensor_is_named_with_both_digests_and_opt_out_loads(tmp_path):
    path = write_jaxkv(tmp_path / "ck")
    _, params, _ = restore(path)
    params["layers.0.wq"][0, 0, 0] += 1.0
    (path / "params").rename(tmp_path / "old_params")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "params", params)
    with pytest.raises(
        ValueError,
        match=r"tensor 'layers\.0\.wq': checksum mismatch \(manifest sha256 "
        r"[0-9a-f]{64}, data [0-9a-f]{64}\)",
    ):
        load_checkpoint(path)
    _, back, _ = load_checkpoint(path, verify_checksums=False)
    np.testing.assert_array_equal(back["layers.0.wq"], params["layers.0.wq"])
    assert convert_main([str(path), str(tmp_path / "out"), "--no-verify-checksums"]) == 0


def test_checkpoint_without_checksums(tmp_path, caplog):
    path = write_jaxkv(tmp_path / "ck")
    marker = path / "jaxkv_checkpoint.json"
    v2 = marker.read_text()
    edit_json(
        marker, lambda m: m.update(version=1, tensors={k: v[:2] for k, v in m["tensors"].items()})
    )
    with caplog.at_level("WARNING", logger="checkpoints.jaxkv_format"):
        restore(path)
    assert "unverified" in caplog.text and "version 1" in caplog.text
    marker.write_text(v2)
    edit_json(marker, lambda m: m["tensors"]["final_norm"].pop())
    with pytest.raises(ValueError, match=r"tensor 'final_norm': no checksum"):
        restore(path)


@pytest.mark.parametrize("verify", [True, False])
def test_manifest_dtype_must_match_the_stored_data(tmp_path, verify):
    path = write_jaxkv(tmp_path / "ck")
    edit_json(
        path / "jaxkv_checkpoint.json", lambda m: m["tensors"]["embed"].__setitem__(1, "bfloat16")
    )
    with pytest.raises(
        ValueError, match=r"tensor 'embed': manifest says bfloat16, the data is float32"
    ):
        restore(path, verify_checksums=verify)


# ------------------------------------------- config values, tokenizer size
@pytest.mark.parametrize("theta", [0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("where", ["rope_theta", "rope_parameters"])
def test_bad_rope_theta_is_refused_not_defaulted(theta, where):
    cfg = {
        **HF_CONFIG,
        **(
            {"rope_theta": theta}
            if where == "rope_theta"
            else {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
        ),
    }
    with pytest.raises(
        ValueError, match=rf"^{where}(\.rope_theta)?: must be a positive finite number"
    ):
        from_hf_config(cfg)
    assert from_hf_config(HF_CONFIG).rope_theta == 10000.0  # only an absent value gets the default


@pytest.mark.parametrize(
    "override,field",
    [
        ({"head_dim": 0}, "head_dim"),
        ({"eos_token_id": {}}, "eos_token_id"),
        ({"eos_token_id": [2, "x"]}, "eos_token_id"),
        ({"bos_token_id": {}}, "bos_token_id"),
        ({"architectures": 5}, "architectures"),
        ({"attention_bias": "yes"}, "attention_bias"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
        ({"rope_parameters": "x"}, "rope_parameters"),
        ({"rope_scaling": 5}, "rope_scaling"),
        ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
        ({"rope_scaling": {"rope_type": "linear", "factor": "abc"}}, r"rope_scaling\.factor"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window"),
    ],
)
def test_present_but_invalid_hf_values_are_refused_by_name(override, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        from_hf_config({**HF_CONFIG, **override})


@pytest.mark.parametrize(
    "key,value",
    [
        ("attention.head_count", 0),
        ("block_count", [1, 2]),
        ("embedding_length", "x"),
        ("rope.freq_base", 0.0),
        ("attention.sliding_window", 0),
        ("attention.key_length", -4),
    ],
)
def test_bad_gguf_metadata_is_refused_by_name(key, value):
    meta = {
        "general.architecture": "llama",
        "llama.vocab_size": V,
        **{f"llama.{k}": v for k, v in GGUF_META.items()},
    }
    with pytest.raises(ValueError, match=rf"^llama\.{re.escape(key)}: "):
        from_gguf_metadata({**meta, f"llama.{key}": value})


@pytest.mark.parametrize(
    "key,value",
    [
        ("tokenizer.ggml.merges", [1, 2]),
        ("tokenizer.ggml.tokens", "abc"),
        ("tokenizer.ggml.scores", ["1"]),
        ("tokenizer.ggml.eos_token_id", "x"),
    ],
)
def test_bad_gguf_tokenizer_types_are_refused_by_name(key, value):
    info = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(V)],
        key: value,
    }
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}: must be"):
        tokenizer_from_gguf(info)


def test_a_sentencepiece_vocabulary_with_an_endless_piece_is_refused_fast():
    # One 1 MB piece once made the merge search run for hours (every cut of it).
    tokens = ["<unk>", "\u2581a", "a" * 2**20] + [f"t{i}" for i in range(V - 3)]
    info = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * V,
    }
    with pytest.raises(ValueError, match=r"^tokenizer\.ggml\.tokens: pieces of up to 1048576"):
        tokenizer_from_gguf(info)


@pytest.mark.parametrize(
    "file,entry,match",
    [
        ("generation_config.json", {"eos_token_id": {}}, r"generation_config\.json: eos_token_id"),
        (
            "generation_config.json",
            {"eos_token_id": [2, 10**6]},
            r"generation_config\.json: eos_token_id",
        ),
        ("tokenizer_config.json", {"eos_token": 5}, r"tokenizer_config\.json: eos_token"),
        ("tokenizer_config.json", {"chat_template": [7]}, r"tokenizer_config\.json: chat_template"),
    ],
)
def test_bad_tokenizer_side_files_are_refused_by_name(tmp_path, file, entry, match):
    path = write_hf(tmp_path / "hf")
    old = json.loads((path / file).read_text()) if (path / file).exists() else {}
    (path / file).write_text(json.dumps({**old, **entry}))
    with pytest.raises(ValueError, match=match):
        load_checkpoint(path)


def test_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer: .*128 .*vocab_size 64"):
        load_checkpoint(write_hf(tmp_path / "hf", tokenizer_vocab=128))
    _, params, tok = load_checkpoint(write_hf(tmp_path / "small", tokenizer_vocab=48))
    with pytest.raises(ValueError, match=r"tokenizer: .*48 .*vocab_size 40"):
        save(
            tmp_path / "ck",
            ModelConfig(**{**CONFIG.to_dict(), "vocab_size": 40, "eos_token_ids": ()}),
            {**params, "embed": params["embed"][:40], "lm_head": params["lm_head"][:, :40]},
            tok,
        )


# ------------------------------------------------------------ convert CLI
BAD_SOURCES = {
    "gguf_heads": (
        lambda root: write_gguf(root / "m.gguf", **{"attention.head_count": 0}),
        r"llama\.attention\.head_count",
    ),
    "hf_eos": (lambda root: write_hf(root / "hf", eos_token_id={}), "eos_token_id"),
    "hf_rope": (
        lambda root: write_hf(root / "hf", rope_parameters={"rope_theta": 0}),
        r"rope_parameters\.rope_theta",
    ),
    "manifest_shape": (lambda root: _hostile(root, "manifest_shape"), "embed"),
    # Found by scripts/probe/__main__.py: named by jaxkv's field, not the file's key.
    "hf_kv_heads": (
        lambda root: write_hf(root / "hf", num_key_value_heads=3),
        "num_key_value_heads",
    ),
    # Found by scripts/probe/__main__.py: a progress bar's lines came before the error.
    "hf_tokenizer_zero": (
        lambda root: _side_file(write_hf(root / "hf"), "tokenizer.json", "zero"),
        r"tokenizer\.json.*not a regular file",
    ),
    # Found by scripts/probe/__main__.py: once "neither a jaxkv checkpoint nor a Hugging Face dir".
    "hf_config_fifo": (
        lambda root: _side_file(write_hf(root / "hf"), "config.json", "fifo"),
        r"config\.json: not a regular file \(a FIFO\)",
    ),
}


def _side_file(path: Path, name: str, how: str) -> Path:
    """`path` with its file `name` replaced by a link to /dev/zero or a FIFO."""
    (path / name).unlink()
    if how == "zero":
        (path / name).symlink_to("/dev/zero")
    else:
        os.mkfifo(path / name)
    return path


@pytest.mark.parametrize("name", sorted(BAD_SOURCES))
def test_convert_prints_one_line_and_fails(tmp_path, capsys, name):
    make, match = BAD_SOURCES[name]
    src = str(make(tmp_path))
    with pytest.raises(SystemExit) as e:
        convert_main([src, str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert (
        e.value.code == 1
        and err.count("\n") == 1
        and err.startswith("error: ")
        and re.search(match, err)
    )
    assert cli_main(["convert", src, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and re.search(match, err), err
    assert not (tmp_path / "out").exists()
