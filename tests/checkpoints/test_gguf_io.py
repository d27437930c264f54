"""load_gguf on small GGUF files written here with gguf.GGUFWriter."""

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from checkpoints import detect_kind, load_checkpoint
from checkpoints.gguf_io import load_gguf

E, F, H, K, D, V, L = 64, 96, 4, 2, 16, 40, 2

# Max abs dequantization error as a fraction of the tensor's max |x|: one
# quantization step (Q4_0/Q5_0 can land a full step off at the clamped end)
# plus slack for the fp16 scales.
TOL = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 8e-3,
    Q.Q8_0: 1.1 / 127,
    Q.Q4_0: 1.1 / 8,
    Q.Q4_1: 1.1 / 15,
    Q.Q5_0: 1.1 / 16,
    Q.Q5_1: 1.1 / 31,
}

LAYER_TYPES = {
    "attn_norm": Q.F32,
    "attn_q": Q.F16,
    "attn_k": Q.Q8_0,
    "attn_v": Q.Q4_0,
    "attn_output": Q.Q4_1,
    "ffn_norm": Q.F32,
    "ffn_gate": Q.BF16,
    "ffn_up": Q.Q5_0,
    "ffn_down": Q.Q5_1,
}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to HF q/k rows, by its index formula: within
    head h, HF row c * D/2 + i goes to GGUF row 2 * i + c."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(d // 2):
            for c in range(2):
                out[h * d + 2 * i + c] = w[h * d + c * (d // 2) + i]
    return out


def hf_weights(arch: str, tied: bool, seed: int = 0, E: int = E) -> dict[str, np.ndarray]:
    """Random HF-layout ([out, in]) float32 weights, keyed by GGUF name."""
    rng = np.random.default_rng(seed)
    w = {
        "token_embd.weight": rng.standard_normal((V, E)),
        "output_norm.weight": rng.standard_normal(E),
    }
    if not tied:
        w["output.weight"] = rng.standard_normal((V, E))
    for i in range(L):
        b = f"blk.{i}."
        w[b + "attn_norm.weight"] = rng.standard_normal(E)
        w[b + "attn_q.weight"] = rng.standard_normal((H * D, E))
        w[b + "attn_k.weight"] = rng.standard_normal((K * D, E))
        w[b + "attn_v.weight"] = rng.standard_normal((K * D, E))
        if arch == "qwen2":
            w[b + "attn_q.bias"] = rng.standard_normal(H * D)
            w[b + "attn_k.bias"] = rng.standard_normal(K * D)
            w[b + "attn_v.bias"] = rng.standard_normal(K * D)
        w[b + "attn_output.weight"] = rng.standard_normal((E, H * D))
        w[b + "ffn_norm.weight"] = rng.standard_normal(E)
        w[b + "ffn_gate.weight"] = rng.standard_normal((F, E))
        w[b + "ffn_up.weight"] = rng.standard_normal((F, E))
        w[b + "ffn_down.weight"] = rng.standard_normal((E, F))
    return {k: v.astype(np.float32) for k, v in w.items()}


def qtype_of(name: str) -> Q:
    if name.startswith("blk."):
        kind = name.split(".")[2]
        return Q.F32 if name.endswith(".bias") else LAYER_TYPES[kind]
    return {"token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_1}.get(name, Q.F32)


def write_gguf(path, arch="llama", tied=False, weights=None, qtypes=None, E=E):
    """A GGUF file as llama.cpp's converter would write it for these HF weights
    (q/k rows permuted for llama); tensor types from ``qtypes`` or `qtype_of`."""
    weights = hf_weights(arch, tied) if weights is None else weights
    w = GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", L)
    w.add_uint32(f"{arch}.context_length", 256)
    w.add_uint32(f"{arch}.embedding_length", E)
    w.add_uint32(f"{arch}.feed_forward_length", F)
    w.add_uint32(f"{arch}.attention.head_count", H)
    w.add_uint32(f"{arch}.attention.head_count_kv", K)
    w.add_uint32(f"{arch}.attention.key_length", D)
    w.add_float32(f"{arch}.rope.freq_base", 5000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(V)])
    w.add_uint32("tokenizer.ggml.eos_token_id", 3)
    for name, x in weights.items():
        qt = (qtypes or {}).get(name, qtype_of(name))
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            x = llama_cpp_permute(x, H if "attn_q" in name else K)
        if x.dtype == np.uint8:  # raw quantized blocks
            w.add_tensor(name, x, raw_dtype=qt)
        elif qt == Q.F32:
            w.add_tensor(name, x)
        elif qt == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def expected_params(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The jaxkv params for HF-layout float weights, mapped independently of
    checkpoints.safetensors_io with explicit transposes."""
    p = {"embed": weights["token_embd.weight"], "final_norm": weights["output_norm.weight"]}
    if "output.weight" in weights:
        p["lm_head"] = weights["output.weight"].T
    for i in range(L):
        g = lambda n: weights[f"blk.{i}.{n}"]  # noqa: E731
        o = f"layers.{i}."
        p[o + "attn_norm"], p[o + "mlp_norm"] = g("attn_norm.weight"), g("ffn_norm.weight")
        p[o + "wq"] = g("attn_q.weight").reshape(H, D, E).transpose(2, 0, 1)
        p[o + "wk"] = g("attn_k.weight").reshape(K, D, E).transpose(2, 0, 1)
        p[o + "wv"] = g("attn_v.weight").reshape(K, D, E).transpose(2, 0, 1)
        p[o + "wo"] = g("attn_output.weight").reshape(E, H, D).transpose(1, 2, 0)
        p[o + "w_gate"], p[o + "w_up"] = g("ffn_gate.weight").T, g("ffn_up.weight").T
        p[o + "w_down"] = g("ffn_down.weight").T
        if f"blk.{i}.attn_q.bias" in weights:
            p[o + "bq"] = g("attn_q.bias").reshape(H, D)
            p[o + "bk"] = g("attn_k.bias").reshape(K, D)
            p[o + "bv"] = g("attn_v.bias").reshape(K, D)
    return p


def source_type(param_name: str, arch: str) -> Q:
    inv = {
        "attn_norm": "attn_norm",
        "mlp_norm": "ffn_norm",
        "wq": "attn_q",
        "wk": "attn_k",
        "wv": "attn_v",
        "wo": "attn_output",
        "w_gate": "ffn_gate",
        "w_up": "ffn_up",
        "w_down": "ffn_down",
    }
    if param_name.startswith("layers."):
        kind = param_name.split(".")[2]
        return Q.F32 if kind in ("bq", "bk", "bv") else LAYER_TYPES[inv[kind]]
    return {"embed": Q.Q8_0, "lm_head": Q.Q4_1}.get(param_name, Q.F32)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_dequantize_and_layout(tmp_path, arch, tied):
    path = tmp_path / "m.gguf"
    weights = write_gguf(path, arch, tied)
    config, params, info = load_gguf(path)
    assert (config.architecture, config.hidden_size, config.intermediate_size) == (arch, E, F)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers) == (
        H,
        K,
        D,
        L,
    )
    assert (config.vocab_size, config.tie_word_embeddings, config.rope_theta) == (V, tied, 5000.0)
    assert config.attention_bias == (arch == "qwen2")
    assert config.eos_token_ids == (3,)
    assert info["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]
    want = expected_params(weights)
    assert sorted(params) == sorted(want)
    errors = {}
    for name, ref in want.items():
        got = params[name]
        assert got.shape == ref.shape and got.dtype == np.float32, name
        qt = source_type(name, arch)
        err = np.abs(got - ref).max()
        bound = TOL[qt] * np.abs(ref).max()
        assert err <= bound, f"{name} ({qt.name}): error {err} > {bound}"
        errors[qt] = max(errors.get(qt, 0.0), err / np.abs(ref).max())
    # the quantized types really were quantized (the bound is not vacuous)
    assert errors[Q.Q4_0] > 1e-3 and errors[Q.Q8_0] > 1e-4 and errors[Q.F32] == 0.0


def test_bfloat16_request(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    _, p32, _ = load_gguf(path)
    _, p16, _ = load_gguf(path, dtype="bfloat16")
    for k in p32:
        assert p16[k].dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(p16[k], p32[k].astype(ml_dtypes.bfloat16))


def test_k_quant_matches_transformers_dequant(tmp_path):
    """Q4_K / Q6_K tensors (blocks of 256) against transformers' own dequantizer."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    e = 256  # the input dim must hold whole K-quant blocks
    rng = np.random.default_rng(3)
    weights = hf_weights("llama", tied=False, E=e)
    qtypes = {}
    for name, qt, block_bytes, half_at in [
        ("blk.0.ffn_gate.weight", Q.Q4_K, 144, (0, 2)),
        ("blk.1.ffn_up.weight", Q.Q6_K, 210, (208,)),
    ]:
        # Random bytes are valid K-quant blocks once the fp16 scales are finite and small.
        blocks = rng.integers(0, 256, size=(F, e // 256, block_bytes), dtype=np.uint8)
        for at in half_at:
            scales = rng.uniform(-1, 1, (F, e // 256, 1)).astype(np.float16)
            blocks[:, :, at : at + 2] = scales.view(np.uint8)
        weights[name] = blocks.reshape(F, -1)
        qtypes[name] = qt
    qtypes.update({n: Q.F32 for n in weights if n not in qtypes})
    path = tmp_path / "k.gguf"
    write_gguf(path, weights=weights, qtypes=qtypes, E=e)
    _, params, _ = load_gguf(path)
    for name, param in [
        ("blk.0.ffn_gate.weight", params["layers.0.w_gate"]),
        ("blk.1.ffn_up.weight", params["layers.1.w_up"]),
    ]:
        flat = torch.from_numpy(weights[name].reshape(-1).copy())
        ref = hf_dequantize(flat, int(qtypes[name])).numpy().reshape(F, e)
        assert np.isfinite(ref).all() and np.abs(ref).max() > 0
        np.testing.assert_allclose(param, ref.T, rtol=1e-6, atol=1e-6)


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "m.gguf"
    weights = hf_weights("llama", tied=False)
    weights["blk.0.attn_norm.weight"] = weights["blk.0.attn_norm.weight"].astype(np.float64)
    write_gguf(path, weights=weights)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_norm\.weight.*F64"):
        load_gguf(path)


def test_unknown_and_missing_tensors(tmp_path):
    weights = hf_weights("llama", tied=False)
    extra = dict(weights, **{"rope_freqs.weight": np.ones(D // 2, np.float32)})
    write_gguf(tmp_path / "a.gguf", weights=extra)
    with pytest.raises(ValueError, match=r"unexpected.*rope_freqs\.weight"):
        load_gguf(tmp_path / "a.gguf")
    fewer = {k: v for k, v in weights.items() if k != "blk.1.ffn_down.weight"}
    write_gguf(tmp_path / "b.gguf", weights=fewer)
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.down_proj\.weight"):
        load_gguf(tmp_path / "b.gguf")


@pytest.fixture(scope="module")
def good_gguf_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("g") / "m.gguf"
    write_gguf(path)
    return path.read_bytes()


@pytest.mark.parametrize("frac", [0.0, 0.001, 0.01, 0.3, 0.9, 0.999])
def test_truncated_gguf(tmp_path, good_gguf_bytes, frac):
    path = tmp_path / "t.gguf"
    path.write_bytes(good_gguf_bytes[: max(1, int(len(good_gguf_bytes) * frac))])
    with pytest.raises(ValueError, match=r"t\.gguf.*(truncated|corrupt)"):
        load_gguf(path)


@pytest.mark.parametrize("prefix", [b"GGUF\x03\x00\x00\x00", b"GGUF", b"NOPE"])
def test_garbage_gguf(tmp_path, prefix):
    path = tmp_path / "g.gguf"
    path.write_bytes(prefix + np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=r"g\.gguf.*(truncated|corrupt)"):
        load_gguf(path)


def test_a_second_load_reads_the_index_and_a_bad_index_is_parsed_again(
    tmp_path, monkeypatch, caplog
):
    """The first load parses with the gguf library and keeps an index in the
    cache; the next load of the same file never calls the reader and gives
    the same config, tensors and tokenizer keys; a corrupt index is logged,
    ignored and written again; a rewritten file is parsed anew."""
    import logging

    from checkpoints import gguf_io

    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "m.gguf"
    write_gguf(path)
    c1, p1, i1 = load_gguf(path)
    (index,) = (tmp_path / "cache" / "gguf").glob("*.json")

    def no_reader(*a, **k):
        raise AssertionError("the reader parsed a file its index holds")

    with monkeypatch.context() as m:
        m.setattr(gguf_io, "GGUFReader", no_reader)
        c2, p2, i2 = load_gguf(path)
    assert c2 == c1 and i2 == i1 and sorted(p2) == sorted(p1)
    assert all(np.array_equal(p1[k], p2[k]) for k in p1)
    index.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        c3, _, _ = load_gguf(path)
    assert c3 == c1 and "GGUF index" in caplog.text
    json.loads(index.read_text())  # written again
    write_gguf(path, "qwen2", True)  # the same path, another model
    assert load_gguf(path)[0].architecture == "qwen2"


def test_detect_by_magic(tmp_path):
    path = tmp_path / "model.bin"
    write_gguf(path)
    assert detect_kind(path) == "gguf"
    config, params, tok = load_checkpoint(path)
    assert tok is not None and config.num_layers == L


def test_gguf_rope_scaling_linear_is_kept_and_others_refused():
    from checkpoints.gguf_config import from_gguf_metadata

    base = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.feed_forward_length": 96,
        "llama.block_count": 2,
        "llama.vocab_size": 128,
    }
    cfg = from_gguf_metadata(
        {**base, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    )
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 2.0)
    assert from_gguf_metadata({**base, "llama.rope.scaling.type": "none"}).rope_scaling is None
    with pytest.raises(ValueError, match="rope.scaling.type: unsupported 'yarn'"):
        from_gguf_metadata({**base, "llama.rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match="rope.scaling.factor: missing"):
        from_gguf_metadata({**base, "llama.rope.scaling.type": "linear"})
