"""jaxkv's orbax checkpoint format and `python -m checkpoints.convert`."""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from checkpoints import detect_kind, load_checkpoint
from checkpoints.convert import convert, main
from checkpoints.gguf_tokenizer import tokenizer_from_gguf
from checkpoints.jaxkv_format import restore, save
from checkpoints.safetensors_io import load_hf_dir
from jaxkv.config import ModelConfig
from jaxkv.model.params import check_params, expected_shapes
from tests.test_tokenizer import tiny_gguf_info

CONFIG = ModelConfig(
    architecture="qwen2",
    vocab_size=300,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    attention_bias=True,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_ids=(1, 2),
)


def random_params(config, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in expected_shapes(config).items()}


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_round_trip(tmp_path, dtype):
    params = random_params(CONFIG, dtype)
    tok = tokenizer_from_gguf(tiny_gguf_info())
    save(tmp_path / "ck", CONFIG, params, tok)
    assert detect_kind(tmp_path / "ck") == "jaxkv"
    config, back, tok2 = restore(tmp_path / "ck")
    assert config == CONFIG
    assert sorted(back) == sorted(params)
    for k in params:
        assert back[k].dtype == np.dtype(dtype) and isinstance(back[k], np.ndarray)
        np.testing.assert_array_equal(back[k], params[k])
    for text in ["hello world", "<|user|>hello<think>", "x y z"]:
        assert tok2.encode(text) == tok.encode(text)
    assert tok2.eos_token_ids == tok.eos_token_ids and tok2.chat_template == tok.chat_template
    _, as32, _ = load_checkpoint(tmp_path / "ck", dtype="float32")
    for k in params:
        assert as32[k].dtype == np.float32
        np.testing.assert_array_equal(as32[k], params[k].astype(np.float32))


def test_save_without_tokenizer_and_overwrite(tmp_path):
    params = random_params(CONFIG)
    save(tmp_path / "ck", CONFIG, params)
    with pytest.raises(ValueError, match="already exists"):
        save(tmp_path / "ck", CONFIG, params)
    params2 = random_params(CONFIG, seed=1)
    save(tmp_path / "ck", CONFIG, params2, overwrite=True)
    _, back, tok = restore(tmp_path / "ck")
    assert tok is None
    np.testing.assert_array_equal(back["embed"], params2["embed"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dirs left


def test_save_rejects_bad_params(tmp_path):
    params = random_params(CONFIG)
    del params["layers.1.bv"]
    with pytest.raises(ValueError, match=r"layers\.1\.bv"):
        save(tmp_path / "ck", CONFIG, params)
    assert not (tmp_path / "ck").exists()


def test_restore_damaged(tmp_path):
    save(tmp_path / "ck", CONFIG, random_params(CONFIG))
    marker = tmp_path / "ck" / "jaxkv_checkpoint.json"
    manifest = json.loads(marker.read_text())
    manifest["tensors"]["embed"][0] = [300, 17]
    marker.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"embed: expected \(300, 16\), got \(300, 17\)"):
        restore(tmp_path / "ck")
    marker.write_text("{garbage")
    with pytest.raises(ValueError, match="corrupt jaxkv checkpoint"):
        restore(tmp_path / "ck")


def test_check_params_messages():
    params = random_params(CONFIG)
    check_params(CONFIG, params)
    params["extra"] = np.zeros(1)
    params["layers.0.wq"] = np.zeros((16, 4, 9))
    del params["final_norm"]
    with pytest.raises(ValueError) as e:
        check_params(CONFIG, params)
    msg = str(e.value)
    assert "final_norm" in msg and "extra" in msg and "layers.0.wq: expected (16, 4, 8)" in msg


def test_expected_shapes_by_hand():
    tied = ModelConfig(
        architecture="llama",
        vocab_size=10,
        hidden_size=6,
        intermediate_size=7,
        num_layers=1,
        num_heads=3,
        num_kv_heads=1,
        head_dim=4,
        tie_word_embeddings=True,
    )
    assert expected_shapes(tied) == {
        "embed": (10, 6),
        "layers.0.attn_norm": (6,),
        "layers.0.wq": (6, 3, 4),
        "layers.0.wk": (6, 1, 4),
        "layers.0.wv": (6, 1, 4),
        "layers.0.wo": (3, 4, 6),
        "layers.0.mlp_norm": (6,),
        "layers.0.w_gate": (6, 7),
        "layers.0.w_up": (6, 7),
        "layers.0.w_down": (7, 6),
        "final_norm": (6,),
    }
    assert len(expected_shapes(CONFIG)) == 2 + 2 * 12 + 1


def test_convert_cli_hf_to_jaxkv(tiny_hf, tmp_path):
    src, _ = tiny_hf["llama"]
    config, params = load_hf_dir(src)
    proc = subprocess.run(
        [sys.executable, "-m", "checkpoints.convert", str(src), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    config2, back, tok = load_checkpoint(tmp_path / "out")
    assert config2 == config and tok is None
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])
    # jaxkv -> jaxkv in bfloat16, in process
    assert main([str(tmp_path / "out"), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    _, back16, _ = restore(tmp_path / "bf16")
    for k in params:
        assert back16[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(back16[k], params[k].astype(ml_dtypes.bfloat16))


def test_convert_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "nothing"), str(tmp_path / "out")])
    assert e.value.code == 1
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a jaxkv checkpoint"):
        convert(tmp_path / "empty", tmp_path / "out")
