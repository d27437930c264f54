"""EAGLE-3 draft heads in the Hugging Face folder layout other engines
read and write: `config.json` (architecture "LlamaForCausalLMEagle3", one
layer, `draft_vocab_size`, `target_hidden_size`, the feature layers as
`eagle_config.eagle_aux_hidden_state_layer_ids`) and safetensors with
torch's [out, in] weights:

    fc.weight [E, 3 Et]                          the feature fusion
    midlayer.input_layernorm / hidden_norm / post_attention_layernorm.weight [E]
    midlayer.self_attn.{q,k,v}_proj.weight [n D, 2 E], o_proj.weight [E, H D]
    midlayer.mlp.{gate,up}_proj.weight [F, E], down_proj.weight [E, F]
    norm.weight [E], lm_head.weight [Vd, E]
    d2t [Vd] (draft id -> target id offset), t2d [V] (target id in the draft vocabulary)
    embed_tokens.weight [V, E]                   optional: else the target's

("layers.0." for "midlayer." and a leading "model." are read too.) The
arrays come out in `jaxkv.model.eagle`'s layout.

    cfg, params = load_eagle3(path, target_config)
    save_eagle3(path, cfg, params)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from checkpoints.hf_config import _rope_scaling_from_hf
from jaxkv.config import ModelConfig
from jaxkv.model.eagle import ARCHITECTURE, Eagle3Config, default_aux_layers
from jaxkv.tokenizer import read_json_file

ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")


def is_eagle3_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(set(cfg.get("architectures") or ()) & set(ARCHITECTURES))


def config_from_hf(
    cfg: Mapping[str, Any], target: ModelConfig, where: str = "config.json"
) -> Eagle3Config:
    """The head's config from its config.json, checked against `target`
    (ValueError naming the field)."""
    archs = cfg.get("architectures") or []
    if not set(archs) & set(ARCHITECTURES):
        raise ValueError(
            f"{where}: architectures {archs} is not an EAGLE-3 head (expected {ARCHITECTURE!r})"
        )
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(
            f"{where}: num_hidden_layers {cfg.get('num_hidden_layers')}: jaxkv "
            f"runs EAGLE-3 heads of one layer"
        )
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{where}: attention_bias / mlp_bias heads are not supported")

    def num(key, default=None):
        v = cfg.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{where}: {key} must be a positive integer, got {v!r}")
        return v

    E, H = num("hidden_size"), num("num_attention_heads")
    aux = (
        (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        or cfg.get("eagle_aux_hidden_state_layer_ids")
        or default_aux_layers(target.num_layers)
    )
    V = num("vocab_size")
    out = Eagle3Config(
        hidden_size=E,
        intermediate_size=num("intermediate_size"),
        num_heads=H,
        num_kv_heads=num("num_key_value_heads", H),
        head_dim=num("head_dim", E // H),
        vocab_size=V,
        draft_vocab_size=num("draft_vocab_size", V),
        target_hidden_size=num("target_hidden_size", E),
        aux_layers=tuple(int(j) for j in aux),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling_from_hf(cfg.get("rope_scaling"), f"{where}: rope_scaling"),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        max_position_embeddings=num("max_position_embeddings", 2048),
    )
    if out.draft_vocab_size > V:
        raise ValueError(f"{where}: draft_vocab_size {out.draft_vocab_size} exceeds vocab_size {V}")
    out.check_target(target)
    return out


def config_to_hf(cfg: Eagle3Config) -> dict:
    d = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": "float32",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
            "use_aux_hidden_state": True,
        },
    }
    rs = cfg.rope_scaling
    if rs is not None:
        d["rope_scaling"] = {k: v for k, v in dataclasses.asdict(rs).items() if v is not None}
    return d


def _hf_names(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    E, F, H, K, D = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    m = "midlayer."
    return {
        "fc.weight": (E, 3 * cfg.target_hidden_size),
        m + "input_layernorm.weight": (E,),
        m + "hidden_norm.weight": (E,),
        m + "post_attention_layernorm.weight": (E,),
        m + "self_attn.q_proj.weight": (H * D, 2 * E),
        m + "self_attn.k_proj.weight": (K * D, 2 * E),
        m + "self_attn.v_proj.weight": (K * D, 2 * E),
        m + "self_attn.o_proj.weight": (E, H * D),
        m + "mlp.gate_proj.weight": (F, E),
        m + "mlp.up_proj.weight": (F, E),
        m + "mlp.down_proj.weight": (E, F),
        "norm.weight": (E,),
        "lm_head.weight": (cfg.draft_vocab_size, E),
    }


def _read_tensors(p: Path) -> dict[str, tuple[tuple[int, ...], Any]]:
    """name -> (shape, loader) over the folder's safetensors files (names
    without a leading "model.", "layers.0." read as "midlayer.")."""
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ValueError(f"eagle3 head {str(p)!r}: no safetensors file")
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="numpy") as h:
                shapes = {n: tuple(h.get_slice(n).get_shape()) for n in h.keys()}
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: corrupt or unreadable safetensors file ({e})") from None
        for name, shape in shapes.items():
            n = name[len("model.") :] if name.startswith("model.") else name
            n = n.replace("layers.0.", "midlayer.")

            def load(f=f, name=name):
                with safe_open(str(f), framework="numpy") as h:
                    return h.get_tensor(name)

            out[n] = (shape, load)
    return out


def load_eagle3(
    path: str | os.PathLike, target: ModelConfig
) -> tuple[Eagle3Config, dict[str, np.ndarray]]:
    """(config, parameters in jaxkv's layout, float32) of the head in folder
    `path`; ValueError naming a missing, unexpected or misshapen tensor, or
    a config that does not fit `target`."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(
            f"eagle3 head {str(p)!r}: no config.json (a folder with config.json "
            f"and safetensors is expected)"
        )
    cfg = config_from_hf(read_json_file(p / "config.json"), target, f"{p}/config.json")
    raw = _read_tensors(p)
    want = _hf_names(cfg)
    missing = sorted(set(want) - set(raw))
    if missing:
        raise ValueError(f"eagle3 head {str(p)!r}: missing tensor(s) {missing}")
    extra = sorted(set(raw) - set(want) - {"d2t", "t2d", "embed_tokens.weight"})
    if extra:
        raise ValueError(f"eagle3 head {str(p)!r}: unexpected tensor(s) {extra[:8]}")
    for n, shape in want.items():
        if tuple(raw[n][0]) != shape:
            raise ValueError(
                f"eagle3 head {str(p)!r}: {n} has shape {list(raw[n][0])}, "
                f"expected {list(shape)} (hidden_size {cfg.hidden_size}, "
                f"target_hidden_size {cfg.target_hidden_size}, draft_vocab_size "
                f"{cfg.draft_vocab_size})"
            )
    w = {n: np.asarray(raw[n][1](), np.float32) for n in want}
    m = "midlayer."
    params = {
        "fc": w["fc.weight"].T,
        "input_norm": w[m + "input_layernorm.weight"],
        "hidden_norm": w[m + "hidden_norm.weight"],
        "post_norm": w[m + "post_attention_layernorm.weight"],
        "wqkv": np.concatenate([w[m + f"self_attn.{x}_proj.weight"].T for x in "qkv"], axis=1),
        "wo": w[m + "self_attn.o_proj.weight"].T,
        "w_gate_up": np.concatenate(
            [w[m + "mlp.gate_proj.weight"].T, w[m + "mlp.up_proj.weight"].T], axis=1
        ),
        "w_down": w[m + "mlp.down_proj.weight"].T,
        "final_norm": w["norm.weight"],
        "lm_head": w["lm_head.weight"].T,
    }
    Vd = cfg.draft_vocab_size
    if "d2t" in raw:
        d2t = np.asarray(raw["d2t"][1]()).astype(np.int64).reshape(-1)
        if d2t.shape != (Vd,):
            raise ValueError(
                f"eagle3 head {str(p)!r}: d2t has {d2t.size} entries, expected "
                f"draft_vocab_size {Vd}"
            )
    elif Vd != cfg.vocab_size:
        raise ValueError(
            f"eagle3 head {str(p)!r}: draft_vocab_size {Vd} < vocab_size "
            f"{cfg.vocab_size} needs the d2t map, which is missing"
        )
    else:
        d2t = np.zeros(Vd, np.int64)
    ids = np.arange(Vd) + d2t
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(
            f"eagle3 head {str(p)!r}: d2t maps draft ids outside the target's "
            f"vocabulary of {cfg.vocab_size}"
        )
    params["d2t"] = d2t.astype(np.int32)
    if "embed_tokens.weight" in raw:
        shape = tuple(raw["embed_tokens.weight"][0])
        if shape != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(
                f"eagle3 head {str(p)!r}: embed_tokens.weight has shape "
                f"{list(shape)}, expected {[cfg.vocab_size, cfg.hidden_size]}"
            )
        params["embed"] = np.asarray(raw["embed_tokens.weight"][1](), np.float32)
    return cfg, {k: np.ascontiguousarray(v) for k, v in params.items()}


def save_eagle3(path: str | os.PathLike, cfg: Eagle3Config, params: Mapping[str, Any]) -> Path:
    """Write the head as config.json + model.safetensors (float32; the
    target's embedding is not written unless the head has its own)."""
    from safetensors.numpy import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    a = {k: np.asarray(v) for k, v in params.items()}
    F = cfg.intermediate_size
    HD, KD = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    m = "midlayer."
    wqkv = a["wqkv"]
    out = {
        "fc.weight": a["fc"].T,
        m + "input_layernorm.weight": a["input_norm"],
        m + "hidden_norm.weight": a["hidden_norm"],
        m + "post_attention_layernorm.weight": a["post_norm"],
        m + "self_attn.q_proj.weight": wqkv[:, :HD].T,
        m + "self_attn.k_proj.weight": wqkv[:, HD : HD + KD].T,
        m + "self_attn.v_proj.weight": wqkv[:, HD + KD :].T,
        m + "self_attn.o_proj.weight": a["wo"].T,
        m + "mlp.gate_proj.weight": a["w_gate_up"][:, :F].T,
        m + "mlp.up_proj.weight": a["w_gate_up"][:, F:].T,
        m + "mlp.down_proj.weight": a["w_down"].T,
        "norm.weight": a["final_norm"],
        "lm_head.weight": a["lm_head"].T,
    }
    out = {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}
    d2t = a["d2t"].astype(np.int64)
    out["d2t"] = d2t
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[np.arange(cfg.draft_vocab_size) + d2t] = True
    out["t2d"] = t2d
    if "embed" in a:
        out["embed_tokens.weight"] = np.ascontiguousarray(a["embed"], np.float32)
    tmp = p / "model.safetensors.tmp"
    save_file(out, str(tmp), metadata={"format": "pt"})
    tmp.replace(p / "model.safetensors")
    (p / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    return p
