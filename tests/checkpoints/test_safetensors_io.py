"""load_hf_dir against the torch modules of tiny random transformers models."""

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from checkpoints import load_checkpoint
from checkpoints.safetensors_io import load_hf_dir
from tests.checkpoints.conftest import copy_dir, state_dict_numpy


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().numpy()


def assert_matches_torch(config, params, model, rtol=1e-5, atol=1e-5):
    """Each jaxkv tensor, used the way the model uses it ('TE,EHD->THD', ...),
    reproduces the corresponding torch module on a random input."""
    torch.manual_seed(1)
    T, E, H, K, D = 5, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    x = torch.randn(T, E)
    xn = _np(x)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)  # noqa: E731
    np.testing.assert_array_equal(params["embed"], _np(model.model.embed_tokens.weight))
    np.testing.assert_array_equal(params["final_norm"], _np(model.model.norm.weight))
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            p = lambda n: params[f"layers.{i}.{n}"]  # noqa: E731
            attn, mlp = layer.self_attn, layer.mlp
            np.testing.assert_array_equal(p("attn_norm"), _np(layer.input_layernorm.weight))
            np.testing.assert_array_equal(p("mlp_norm"), _np(layer.post_attention_layernorm.weight))
            q = np.einsum("TE,EHD->THD", xn, p("wq"))
            k = np.einsum("TE,EKD->TKD", xn, p("wk"))
            v = np.einsum("TE,EKD->TKD", xn, p("wv"))
            if config.attention_bias:
                q, k, v = q + p("bq"), k + p("bk"), v + p("bv")
            close(q, _np(attn.q_proj(x)).reshape(T, H, D))
            close(k, _np(attn.k_proj(x)).reshape(T, K, D))
            close(v, _np(attn.v_proj(x)).reshape(T, K, D))
            y = torch.randn(T, H * D)
            close(np.einsum("THD,HDE->TE", _np(y).reshape(T, H, D), p("wo")), _np(attn.o_proj(y)))
            close(xn @ p("w_gate"), _np(mlp.gate_proj(x)))
            close(xn @ p("w_up"), _np(mlp.up_proj(x)))
            z = torch.randn(T, config.intermediate_size)
            close(_np(z) @ p("w_down"), _np(mlp.down_proj(z)))
        if config.tie_word_embeddings:
            assert "lm_head" not in params
        else:
            close(xn @ params["lm_head"], _np(model.lm_head(x)))


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama_sharded"])
def test_load_matches_torch(tiny_hf, name):
    path, model = tiny_hf[name]
    config, params = load_hf_dir(path)
    hf = model.config
    assert config.architecture == hf.model_type
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
    )
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert all(
        type(v) is np.ndarray and v.dtype == np.float32 and v.flags.c_contiguous
        for v in params.values()
    )
    assert_matches_torch(config, params, model)


def test_sharded_dir_really_is_sharded(tiny_hf):
    path, _ = tiny_hf["llama_sharded"]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_bfloat16_checkpoint_and_dtype(tiny_hf, tmp_path):
    _, model = tiny_hf["llama"]
    model_bf16 = type(model)(model.config)
    model_bf16.load_state_dict(model.state_dict())
    model_bf16 = model_bf16.to(torch.bfloat16)
    model_bf16.save_pretrained(tmp_path)
    config, params = load_hf_dir(tmp_path)  # bf16 on disk -> float32, exactly
    np.testing.assert_array_equal(params["embed"], _np(model_bf16.model.embed_tokens.weight))
    assert_matches_torch(config, params, model_bf16.float(), rtol=1e-4, atol=1e-4)
    _, params16 = load_hf_dir(tmp_path, dtype="bfloat16")
    assert all(v.dtype == ml_dtypes.bfloat16 for v in params16.values())
    for k in params:
        np.testing.assert_array_equal(params16[k].astype(np.float32), params[k])


def test_load_checkpoint_detects_hf(tiny_hf):
    path, model = tiny_hf["qwen2"]
    config, params, tok = load_checkpoint(path)
    assert tok is None  # no tokenizer.json saved
    assert_matches_torch(config, params, model)


def _rewrite(path, edit):
    """Edit the tensors of path/model.safetensors (read fully before rewriting)."""
    tensors = {k: v.copy() for k, v in load_file(path / "model.safetensors").items()}
    edit(tensors)
    save_file(tensors, path / "model.safetensors.new")
    (path / "model.safetensors.new").replace(path / "model.safetensors")


def test_unknown_architecture(tiny_hf, tmp_path):
    path = copy_dir(tiny_hf["llama"][0], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM"):
        load_hf_dir(path)


def test_missing_tensor(tiny_hf, tmp_path):
    path = copy_dir(tiny_hf["llama"][0], tmp_path / "m")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_dir(path)


def test_unexpected_tensor(tiny_hf, tmp_path):
    path = copy_dir(tiny_hf["llama"][0], tmp_path / "m")
    _rewrite(
        path, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)})
    )
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.self_attn\.o_proj\.bias"):
        load_hf_dir(path)


def test_wrong_shape(tiny_hf, tmp_path):
    path = copy_dir(tiny_hf["llama"][0], tmp_path / "m")
    _rewrite(path, lambda t: t.update({"model.norm.weight": np.ones(31, np.float32)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected \(32,\), got \(31,\)"):
        load_hf_dir(path)


def test_tied_lm_head_and_inv_freq_are_dropped(tiny_hf, tmp_path):
    path, model = tiny_hf["qwen2"]
    path = copy_dir(path, tmp_path / "m")
    sd = state_dict_numpy(model)

    def add(t):
        t["lm_head.weight"] = sd["model.embed_tokens.weight"]
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)

    _rewrite(path, add)
    config, params = load_hf_dir(path)
    assert "lm_head" not in params
    assert_matches_torch(config, params, model)


@pytest.mark.parametrize("keep", [0, 5, 30, -7])
def test_truncated_safetensors(tiny_hf, tmp_path, keep):
    path = copy_dir(tiny_hf["llama"][0], tmp_path / "m")
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(ValueError, match=r"model\.safetensors.*(truncated|corrupt)"):
        load_hf_dir(path)


def test_garbage_safetensors(tiny_hf, tmp_path):
    path = copy_dir(tiny_hf["llama"][0], tmp_path / "m")
    rng = np.random.default_rng(0)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + rng.bytes(200))
    with pytest.raises(ValueError, match=r"model\.safetensors.*corrupt"):
        load_hf_dir(path)


@pytest.mark.parametrize("bad", ["not json {", '{"weight_map": 3}', "missing_shard", "wrong_shard"])
def test_bad_index(tiny_hf, tmp_path, bad):
    path = copy_dir(tiny_hf["llama_sharded"][0], tmp_path / "m")
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if bad == "missing_shard":
        index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
        text = json.dumps(index)
    elif bad == "wrong_shard":
        files = sorted(set(index["weight_map"].values()))
        name = next(k for k, v in index["weight_map"].items() if v == files[0])
        index["weight_map"][name] = files[1]
        text = json.dumps(index)
    else:
        text = bad
    index_path.write_text(text)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json.*corrupt"):
        load_hf_dir(path)


def _write_raw_safetensors(path, header: dict, data: bytes):
    import json as _json

    raw = _json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


@pytest.mark.parametrize(
    "offsets,what",
    [
        ([[0, 16], [0, 16]], "two tensors share the same bytes"),
        ([[0, 16], [8, 24]], "overlapping tensors"),
        ([[0, 16], [16, 40]], "a tensor past the end of the file"),
    ],
)
def test_bad_offsets_are_refused_naming_the_file(tmp_path, offsets, what):
    from checkpoints.safetensors_io import open_safetensors

    path = tmp_path / "model.safetensors"
    header = {
        n: {"dtype": "F32", "shape": [4], "data_offsets": o}
        for n, o in zip(("a.weight", "b.weight"), offsets)
    }
    _write_raw_safetensors(path, header, bytes(32))
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt or truncated"):
        open_safetensors(path)


@pytest.mark.parametrize(
    "header,data,match",
    [
        (
            {"a.weight": {"dtype": "I32", "shape": [4], "data_offsets": [0, 16]}},
            bytes(16),
            "unsupported dtype I32",
        ),
        (
            {"a.weight": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}},
            bytes(16),
            "corrupt or truncated",
        ),
        (["not", "an", "object"], b"", "corrupt or truncated"),
        (
            {"a.weight": {"dtype": "F32", "shape": "four", "data_offsets": [0, 16]}},
            bytes(16),
            "corrupt or truncated",
        ),
    ],
)
def test_bad_headers_are_refused_naming_the_file(tmp_path, header, data, match):
    from checkpoints.safetensors_io import open_safetensors

    path = tmp_path / "model.safetensors"
    _write_raw_safetensors(path, header, data)
    with pytest.raises(ValueError, match=rf"model\.safetensors: .*{match}"):
        open_safetensors(path)


def test_header_longer_than_the_file(tmp_path):
    from checkpoints.safetensors_io import open_safetensors

    path = tmp_path / "model.safetensors"
    path.write_bytes((10**6).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt or truncated"):
        open_safetensors(path)


def test_config_without_a_required_field(tiny_hf, tmp_path):
    import json as _json
    import shutil

    from checkpoints import load_checkpoint

    src = tiny_hf["llama"][0]
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    cfg = _json.loads((dst / "config.json").read_text())
    del cfg["intermediate_size"]
    (dst / "config.json").write_text(_json.dumps(cfg))
    with pytest.raises(ValueError, match="intermediate_size: missing"):
        load_checkpoint(dst)
