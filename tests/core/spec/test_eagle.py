"""EAGLE-3 draft heads: the engine's proposals are those of a float64
reference of the published head reading Hugging Face transformers' own
hidden states; speculation with a random or a trained head is lossless
(greedy and seeded, under chunked prefill, prefix hits and preemption);
heads of the Hugging Face layout load and a mismatched one is refused by
name; nothing compiles after warm-up; training lowers the loss, raises the
held-out acceptance (as the engine then measures it on those prompts), and a
stopped run resumes to the same state."""

import json

import numpy as np
import pytest

from checkpoints.eagle3 import load_eagle3, save_eagle3
from jaxkv.config import EngineConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.core.spec import eagle as engine_eagle
from jaxkv.core.spec.decode import SpecControl
from jaxkv.model.eagle import Eagle3Config, random_params
from jaxkv.model.llama import Llama
from tests.core.spec.test_spec_decode import CFG, _params, _pressure, _prompts, _run, _same
from tests.helpers.compile_count import count_compiles


def _spec(path, k=3):
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k, "adaptive": False}


@pytest.fixture(scope="module")
def model():
    return Llama.random_init(CFG, seed=1)


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    cfg = Eagle3Config.for_target(CFG, draft_vocab_size=150)
    d2t = np.sort(np.random.default_rng(3).choice(CFG.vocab_size, 150, replace=False))
    path = tmp_path_factory.mktemp("head")
    save_eagle3(path, cfg, random_params(cfg, 5, d2t=d2t - np.arange(150)))
    return path


# ------------------------------------------------------------ the format


def _hf_folder(
    path,
    E=64,
    Et=64,
    H=4,
    K=2,
    D=16,
    F=96,
    V=128,
    Vd=100,
    layer_ids=(1, 2, 3),
    arch="LlamaForCausalLMEagle3",
    with_embed=False,
):
    """A head folder written the way other projects' trainers write one:
    torch [out, in] names, int64 d2t, bool t2d (random weights)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    ids = np.sort(rng.choice(V, Vd, replace=False))
    t2d = np.zeros(V, bool)
    t2d[ids] = True
    w = {
        "fc.weight": r(E, 3 * Et),
        "midlayer.input_layernorm.weight": r(E),
        "midlayer.hidden_norm.weight": r(E),
        "midlayer.post_attention_layernorm.weight": r(E),
        "midlayer.self_attn.q_proj.weight": r(H * D, 2 * E),
        "midlayer.self_attn.k_proj.weight": r(K * D, 2 * E),
        "midlayer.self_attn.v_proj.weight": r(K * D, 2 * E),
        "midlayer.self_attn.o_proj.weight": r(E, H * D),
        "midlayer.mlp.gate_proj.weight": r(F, E),
        "midlayer.mlp.up_proj.weight": r(F, E),
        "midlayer.mlp.down_proj.weight": r(E, F),
        "norm.weight": r(E),
        "lm_head.weight": r(Vd, E),
        "d2t": (ids - np.arange(Vd)).astype(np.int64),
        "t2d": t2d,
    }
    if with_embed:
        w["embed_tokens.weight"] = r(V, E)
    path.mkdir(parents=True, exist_ok=True)
    save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": [arch],
                "model_type": "llama",
                "hidden_size": E,
                "intermediate_size": F,
                "num_attention_heads": H,
                "num_key_value_heads": K,
                "head_dim": D,
                "num_hidden_layers": 1,
                "vocab_size": V,
                "draft_vocab_size": Vd,
                "target_hidden_size": Et,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "max_position_embeddings": 256,
                "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)},
            }
        )
    )
    return w


def test_a_head_of_the_published_layout_loads_and_mismatches_are_named(tmp_path):
    from jaxkv.config import ModelConfig

    target = ModelConfig(
        architecture="llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    w = _hf_folder(tmp_path / "h", with_embed=True)
    cfg, p = load_eagle3(tmp_path / "h", target)
    assert cfg.aux_layers == (1, 2, 3) and cfg.draft_vocab_size == 100
    np.testing.assert_array_equal(p["wqkv"][:, :64], w["midlayer.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(p["wqkv"][:, 64:96], w["midlayer.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(p["w_gate_up"][:, 96:], w["midlayer.mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(p["fc"], w["fc.weight"].T)
    np.testing.assert_array_equal(np.arange(100) + p["d2t"], np.flatnonzero(w["t2d"]))
    np.testing.assert_array_equal(p["embed"], w["embed_tokens.weight"])
    # written back, it reads the same
    save_eagle3(tmp_path / "again", cfg, p)
    cfg2, p2 = load_eagle3(tmp_path / "again", target)
    assert cfg2 == cfg and all(np.array_equal(p[k], p2[k]) for k in p)
    for kw, words in (
        (dict(V=100, Vd=90), "vocab"),
        (dict(Et=32), "target_hidden_size"),
        (dict(layer_ids=(1, 2, 9)), "layer ids"),
        (dict(arch="LlamaForCausalLM"), "architectures"),
    ):
        _hf_folder(tmp_path / "bad", **kw)
        with pytest.raises(ValueError, match=words):
            load_eagle3(tmp_path / "bad", target)


# ------------------------------------------------------------ the reference


def _rms(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, D, theta=10000.0):
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    ang = pos[:, None] * inv[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([a * c - b * s, b * c + a * s], -1)


def reference_chain(w, embed, feats, tokens, k, H, K, D, F):
    """The head's k greedy proposals after `tokens`, in float64 from the
    Hugging Face names: the K/V of positions 0..P from (features p, token
    p + 1), then a chain from position P = len - 2 (EAGLE-3 as vLLM
    runs it)."""
    f = {n: np.asarray(v, np.float64) for n, v in w.items() if n not in ("d2t", "t2d")}
    m = "midlayer."
    E = f["fc.weight"].shape[0]

    def layer(hid, toks, pos, keys, vals):
        x = np.concatenate(
            [
                _rms(embed[toks], f[m + "input_layernorm.weight"]),
                _rms(hid, f[m + "hidden_norm.weight"]),
            ],
            -1,
        )
        q = (x @ f[m + "self_attn.q_proj.weight"].T).reshape(-1, H, D)
        kk = (x @ f[m + "self_attn.k_proj.weight"].T).reshape(-1, K, D)
        vv = (x @ f[m + "self_attn.v_proj.weight"].T).reshape(-1, K, D)
        q, kk = _rope(q, pos, D), _rope(kk, pos, D)
        keys, vals = np.concatenate([keys, kk]), np.concatenate([vals, vv])
        n = len(keys)
        qpos = np.arange(n - len(pos), n)
        o = np.zeros((len(pos), H, D))
        for h in range(H):
            s = q[:, h] @ keys[:, h // (H // K)].T / np.sqrt(D)
            s = np.where(np.arange(n)[None] <= qpos[:, None], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            o[:, h] = (p / p.sum(-1, keepdims=True)) @ vals[:, h // (H // K)]
        r = o.reshape(len(pos), -1) @ f[m + "self_attn.o_proj.weight"].T + hid
        hn = _rms(r, f[m + "post_attention_layernorm.weight"])
        g, u = hn @ f[m + "mlp.gate_proj.weight"].T, hn @ f[m + "mlp.up_proj.weight"].T
        pre = r + (g / (1 + np.exp(-g)) * u) @ f[m + "mlp.down_proj.weight"].T
        logits = _rms(pre[-1:], f["norm.weight"]) @ f["lm_head.weight"].T
        d = int(np.argmax(logits[0]))
        return pre[-1:], d + int(w["d2t"][d]), keys, vals

    P = len(tokens) - 2
    hid = np.asarray(feats[: P + 1], np.float64) @ f["fc.weight"].T
    keys, vals = np.zeros((0, K, D)), np.zeros((0, K, D))
    pre, tok, keys, vals = layer(hid, np.asarray(tokens[1 : P + 2]), np.arange(P + 1), keys, vals)
    out = [tok]
    for j in range(1, k):
        pre, tok, keys, vals = layer(pre, np.asarray([tok]), np.asarray([P + j]), keys, vals)
        out.append(tok)
    del E, F
    return out


def test_engine_proposals_are_the_reference_heads_on_transformers_features(tmp_path, monkeypatch):
    import torch

    from checkpoints.loader import load_model
    from tests.helpers.model_utils import make_hf_model

    hf, path = make_hf_model("llama", tmp_path / "target", num_hidden_layers=4)
    target, _ = load_model(str(path))
    w = _hf_folder(tmp_path / "head", layer_ids=(1, 2, 3))
    seen = []
    fill = engine_eagle.EagleProposer.fill

    def recording_fill(self, scheduled):
        fill(self, scheduled)
        seen.extend(
            (list(sc.seq.all_token_ids), list(sc.spec_tokens)) for sc in scheduled if sc.spec_tokens
        )

    monkeypatch.setattr(engine_eagle.EagleProposer, "fill", recording_fill)
    loops = []
    follow_loop = engine_eagle.EagleProposer._follow_loop
    monkeypatch.setattr(
        engine_eagle.EagleProposer,
        "_follow_loop",
        lambda self, *a: loops.append(1) or follow_loop(self, *a),
    )
    rng = np.random.default_rng(4)
    prompts = [list(rng.integers(3, 128, n)) for n in (5, 19, 40)]
    calls = []

    def every_other(self, drafts, num_seqs, kind):  # the gate refusing every other step:
        calls.append(1)  # decode loops of several calls between
        return len(calls) % 2 == 0

    for gate in (None, every_other):
        if gate is not None:
            monkeypatch.setattr(SpecControl, "allow", gate)
        eng = LLMEngine(
            target,
            None,
            EngineConfig(
                warmup=False,
                num_pages=40,
                page_size=8,
                max_num_seqs=4,
                max_num_batched_tokens=16,
                num_decode_steps=4,
                speculative_config=_spec(tmp_path / "head", k=3),
            ),
        )
        for p in prompts:
            eng.add_request(p, SamplingParams(max_tokens=16, temperature=0.0))
        eng.run_to_completion()
    assert len(seen) >= 10 and loops, (len(seen), len(loops))
    embed = hf.model.embed_tokens.weight.detach().double().numpy()
    checked = 0
    for toks, props in seen:
        with torch.no_grad():
            hs = hf(torch.tensor([toks]), output_hidden_states=True).hidden_states
        feats = np.concatenate([hs[j][0].double().numpy() for j in (1, 2, 3)], -1)
        ref = reference_chain(w, embed, feats, toks, len(props), H=4, K=2, D=16, F=96)
        assert props == ref, (len(toks), props, ref)
        checked += len(props)
    assert checked >= 25


# ------------------------------------------------------------ lossless


def test_random_head_is_lossless_under_pressure(model, random_head):
    prompts = _prompts(18, seed=2)
    _, plain = _run(model, prompts, None, num_pages=36)
    eng, out = _run(model, prompts, _spec(random_head), num_pages=36)
    _same(out, plain)
    _pressure(eng)
    assert eng.speculative_metrics()["proposed"] > 100


def test_requests_ending_inside_a_decode_loop_at_a_page_end(model, random_head):
    """With the adaptive gate (the default) refusing a random head, decodes
    run in loops of 8 calls that the head follows; a request whose
    max_tokens ends inside a loop holds pages for its own rows only. With
    every max_tokens from 4 to 11 one of them ends on a page's last slot:
    the run completes, with plain decoding's tokens."""
    rng = np.random.default_rng(0)
    reqs = [([int(x) for x in rng.integers(0, CFG.vocab_size, 10)], m) for m in range(4, 12)]
    reqs.append(([int(x) for x in rng.integers(0, CFG.vocab_size, 9)], 40))

    def go(spec):
        eng = LLMEngine(
            model,
            None,
            EngineConfig(
                warmup=False,
                num_pages=64,
                page_size=8,
                max_num_seqs=9,
                max_num_batched_tokens=64,
                speculative_config=spec,
            ),
        )
        ids = [
            eng.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=m))
            for p, m in reqs
        ]
        out = eng.run_to_completion()
        return [out[i].outputs[0].token_ids for i in ids]

    spec = dict(_spec(random_head), adaptive=True)
    assert go(spec) == go(None)


def test_after_warm_up_requests_with_an_eagle_head_compile_nothing(model, random_head):
    eng = LLMEngine(
        model,
        None,
        EngineConfig(
            num_pages=32,
            page_size=8,
            max_num_seqs=8,
            max_num_batched_tokens=32,
            speculative_config=_spec(random_head, 2),
        ),
    )
    prompts = _prompts(60, seed=3)
    with count_compiles() as compiles:
        for i in range(60):
            eng.add_request(prompts[i], _params(i))
            if i % 10 == 9:
                eng.step()
        eng.run_to_completion()
    assert eng.speculative_metrics()["steps"] > 0
    assert compiles == [], f"{len(compiles)} XLA compiles after warm-up"


# ------------------------------------------------------------ training


@pytest.fixture(scope="module")
def tiny_data(model):
    """The tiny target's greedy answers to random prompts, recorded for
    training (120 sequences) and held out (24)."""
    from jaxkv.training.draft_data import answer, target_features

    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, CFG.vocab_size, int(rng.integers(4, 20)))) for _ in range(144)]
    eng = LLMEngine(
        model,
        None,
        EngineConfig(
            warmup=False, num_pages=200, page_size=8, max_num_seqs=16, max_num_batched_tokens=64
        ),
    )
    seqs, starts = answer(eng, None, prompts, 40)
    cfg = Eagle3Config.for_target(CFG)
    data = target_features(model, seqs, cfg.aux_layers, 64, starts=starts)
    return cfg, {k: v[:120] for k, v in data.items()}, {k: v[120:] for k, v in data.items()}


def _train(model, tiny_data, ckpt, **kw):
    from jaxkv.model.eagle import target_embed as _target_embed
    from jaxkv.training.draft_data import choose_vocab
    from jaxkv.training.trainer import init_params, train

    cfg, data, held = tiny_data
    d2t = choose_vocab(data["labels"], data["mask"], CFG.vocab_size, 180)
    cfg = Eagle3Config.for_target(CFG, draft_vocab_size=180)
    return cfg, train(
        cfg,
        init_params(cfg, model, d2t),
        _target_embed(model),
        data,
        batch_size=8,
        heldout=held,
        eval_every=20,
        chain=3,
        lr=3e-3,
        ckpt_dir=ckpt,
        save_every=20,
        progress=False,
        **kw,
    )


def test_training_lowers_the_loss_raises_acceptance_and_resumes_to_the_same_state(
    model, tiny_data, tmp_path
):
    from jaxkv.model.eagle import target_embed as _target_embed
    from jaxkv.training.trainer import Trainer

    cfg, (tr, history) = _train(model, tiny_data, tmp_path / "a", steps=60)
    start = Trainer(cfg, _fresh(model, tiny_data), _target_embed(model), steps=1, chain=3).evaluate(
        tiny_data[2]
    )
    end = history[-1]
    assert end["loss"] < 0.9 * start["loss"], (start, history)
    assert end["accept"] > start["accept"] + 0.05, (start, history)
    # stopped after 20 steps (a checkpoint at 20), then run again: it resumes
    _, (half, _) = _train(model, tiny_data, tmp_path / "b", steps=60, stop_after=20)
    assert half.step == 20
    half.close()
    _, (resumed, _) = _train(model, tiny_data, tmp_path / "b", steps=60)
    assert resumed.step == 60
    for k, v in tr.params().items():
        np.testing.assert_allclose(resumed.params()[k], v, rtol=1e-6, atol=1e-7, err_msg=k)
    # the trained head speculates losslessly, with accepted proposals
    save_eagle3(tmp_path / "head", cfg, tr.params())
    prompts = _prompts(18, seed=5)
    _, plain = _run(model, prompts, None, num_pages=36)
    eng, out = _run(model, prompts, _spec(tmp_path / "head"), num_pages=36)
    _same(out, plain)
    _pressure(eng)
    assert eng.speculative_metrics()["accepted"] > 10, eng.speculative_metrics()
    # the held-out figure training reports is the one the engine measures
    # answering those prompts (its mean over every position reads higher)
    from jaxkv.training.draft_data import answer

    held = tiny_data[2]
    prompts = [[int(x) for x in t[:s]] for t, s in zip(held["tokens"], held["start"])]
    eng = LLMEngine(
        model,
        None,
        EngineConfig(
            warmup=False,
            num_pages=200,
            page_size=8,
            max_num_seqs=16,
            max_num_batched_tokens=64,
            speculative_config=_spec(tmp_path / "head"),
        ),
    )
    seqs, _ = answer(eng, None, prompts, 40)
    assert seqs == [[int(x) for x in t[: s + 40]] for t, s in zip(held["tokens"], held["start"])]
    got = eng.speculative_metrics()["mean_accepted_length"]
    assert abs(end["per_step"] - got) < 0.005 and got < end["accept"], (end, got)


def test_frozen_output_rows_stay_and_a_resume_with_other_options_is_refused(
    model, tiny_data, tmp_path
):
    """`freeze` (what `jaxkv train-draft` does to the output rows unless
    --train-output): those stay the target's, bit for bit, while the rest
    trains; a checkpoint of one choice is not resumed under the other."""
    fresh = _fresh(model, tiny_data)
    _, (tr, _) = _train(model, tiny_data, tmp_path / "c", steps=4, freeze=("lm_head",))
    got = tr.params()
    tr.close()
    np.testing.assert_array_equal(got["lm_head"], fresh["lm_head"])
    assert not np.allclose(got["fc"], fresh["fc"])
    with pytest.raises(ValueError, match="lm_head.*give a fresh --out"):
        _train(model, tiny_data, tmp_path / "c", steps=8)


def test_copy_init_head_proposes_what_followed_before():
    """induction_init: before any training, in text that repeats itself,
    the head proposes the tokens that followed the earlier occurrence (the
    oracle is the text: its own next tokens are the labels), through a
    tiny target with tied embeddings (as SmolLM2's); a random head
    proposes none. The lowest feature layer here is the embedding (a
    random target's layer 1 keeps too little of its token for the token
    probe, which reads SmolLM2's layer 2 at 97.7%)."""
    import dataclasses

    from jaxkv.model.eagle import target_embed as _target_embed
    from jaxkv.training.draft_data import target_features
    from jaxkv.training.trainer import Trainer, init_params

    model = Llama.random_init(dataclasses.replace(CFG, tie_word_embeddings=True), seed=1)
    rng = np.random.default_rng(7)
    seqs = [list(rng.choice(CFG.vocab_size, 24, replace=False)) * 2 for _ in range(24)]
    cfg = Eagle3Config.for_target(CFG, aux_layers=(0, 1, 2))
    data = target_features(model, seqs, cfg.aux_layers, 48, starts=[24] * 24)
    data["labels"] = np.roll(data["tokens"], -1, axis=1)  # the text's own next token
    d2t = np.zeros(CFG.vocab_size, np.int32)
    accept = {}
    for init in ("random", "copy"):
        params = init_params(cfg, model, d2t, data=data if init == "copy" else None)
        accept[init] = Trainer(cfg, params, _target_embed(model), steps=1, chain=3).evaluate(data)[
            "accept"
        ]
    assert accept["random"] < 1.2 and accept["copy"] > 1.9, accept  # of at most 4


def _fresh(model, tiny_data):
    from jaxkv.training.draft_data import choose_vocab
    from jaxkv.training.trainer import init_params

    cfg, data, _ = tiny_data
    d2t = choose_vocab(data["labels"], data["mask"], CFG.vocab_size, 180)
    return init_params(Eagle3Config.for_target(CFG, draft_vocab_size=180), model, d2t)


def test_eagle_under_tensor_parallel_matches_one_device(tmp_path):
    import os
    import subprocess
    import sys

    from jaxkv.config import ModelConfig
    from tests.core.spec.test_spec_decode import TP_SCRIPT

    cfg = Eagle3Config.for_target(
        ModelConfig(  # the script's target
            architecture="llama",
            vocab_size=212,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=8,
            num_kv_heads=2,
            head_dim=16,
            max_position_embeddings=512,
        )
    )
    save_eagle3(tmp_path / "head", cfg, random_params(cfg, 1))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")

    def go(tp, spec):
        out = subprocess.run(
            [sys.executable, "-c", TP_SCRIPT, str(tp), json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    one = go(1, None)
    two = go(2, _spec(tmp_path / "head"))
    assert two["tokens"] == one["tokens"]


def test_train_draft_command_writes_a_head_the_engine_serves(tmp_path):
    from jaxkv.entrypoints.cli import main
    from tests.helpers.model_utils import WORDS, make_hf_model, save_tiny_tokenizer

    _, path = make_hf_model("llama", tmp_path / "m", num_hidden_layers=4)
    save_tiny_tokenizer(path)
    rng = np.random.default_rng(1)
    for name, n in (("train.jsonl", 24), ("held.jsonl", 6)):
        with open(tmp_path / name, "w") as f:
            for _ in range(n):
                f.write(json.dumps({"prompt": " ".join(rng.choice(WORDS, 6))}) + "\n")
    out = tmp_path / "head"
    args = [
        "train-draft",
        "--model",
        str(path),
        "--data",
        str(tmp_path / "train.jsonl"),
        "--held-out",
        str(tmp_path / "held.jsonl"),
        "--out",
        str(out),
        "--steps",
        "6",
        "--max-tokens",
        "12",
        "--length",
        "48",
        "--draft-vocab",
        "64",
        "--eval-every",
        "3",
        "--save-every",
        "3",
        "--batch-size",
        "4",
    ]
    assert main(args) == 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 6 and [h["step"] for h in summary["held_out"]] == [3, 6]
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
    # run again: it finds its checkpoint at the last step and trains no more
    assert main(args) == 0
    prompts = ["the cat sat", "a dog ran far away"]
    outs = []
    for spec in (None, _spec(out)):
        eng = LLMEngine.from_pretrained(
            str(path),
            warmup=False,
            num_pages=32,
            page_size=8,
            max_num_seqs=4,
            speculative_config=spec,
        )
        ids = [eng.add_request(p, SamplingParams(max_tokens=10, temperature=0.0)) for p in prompts]
        done = eng.run_to_completion()
        outs.append([done[i].outputs[0].token_ids for i in ids])
    assert outs[0] == outs[1]
