"""ModelConfig: the shape and numerics of the one decoder, family by family
in its fields rather than in code.

ModelConfig is built by exactly one function per source: `from_hf_config` for
a Hugging Face ``config.json`` dict and `from_gguf_metadata` for GGUF
key/values. Both live in `checkpoints.hf_config` and validate with
`ModelConfig.validate`, which names the offending field.

What the families differ in (defaults are Llama's):

    field                   llama/mistral/qwen2  qwen3     gemma2            gemma3
    layer_types             all full (mistral:   all full  sliding / full    5 sliding : 1 full
                            all sliding)                   alternating
    rope_local_theta        -                    -         -                 10000 (sliding)
    norm_offset             0 (w)                0         1 (1 + w)         1
    post_norms              no                   no        yes               yes
    qk_norm                 no                   yes       no                yes
    hidden_act              silu                 silu      gelu_tanh         gelu_tanh
    embed_scale             no                   no        sqrt(E)           sqrt(E)
    query_pre_attn_scalar   head_dim             head_dim  from config       from config
    attn_logit_softcap      -                    -         50                -
    final_logit_softcap     -                    -         30                -

`attention_sinks` (a learned logit per query head in the softmax's
denominator, gpt-oss) works with any of them.

Mixtures of experts (`jaxkv.model.moe`; the rest as qwen3 / qwen2 / mistral):

    field                            qwen3_moe        qwen2_moe          mixtral / gpt_oss
    num_experts (X)                  num_experts      num_experts        num_local_experts
    num_experts_per_tok (k)          from config      from config        from config
    moe_intermediate_size            from config      from config        intermediate_size
    norm_topk_prob                   from config      from config        always
    shared_expert_intermediate_size  0                from config        0
    sparse_layers                    not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0;
                                     mixtral, gpt_oss: every layer
    moe_bias, swiglu_limit           -                -                  gpt_oss: router and expert
                                                                         biases, clamped SwiGLU

gpt_oss is otherwise attention biases (q/k/v and o), sinks, sliding and full
layers alternating, and YaRN RoPE.

Shape legend used throughout jaxkv: B batch, T tokens, S sequences, L layers,
H query heads, K/KVH kv heads, D head dim, P pages, V vocab, E embed,
F MLP hidden (intermediate).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

SUPPORTED_MODEL_TYPES = {
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "gpt_oss",
}
LAYER_TYPES = ("full_attention", "sliding_attention")
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling. "linear": every inverse frequency divided by `factor`
    (positions interpolated). "llama3": frequency-dependent (long
    wavelengths divided by `factor`, short ones kept, a smooth band between),
    which also uses the three fields after `factor`. "yarn": the frequencies
    that turn fewer than `beta_slow` times over the original context
    divided by `factor`, those turning more than `beta_fast` times kept, a
    linear ramp over the dimensions between (`truncate`: its ends rounded
    outward to whole dimensions); cos and sin are then multiplied by
    `attention_factor` (so every q.k by its square)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear", "yarn"):
            raise ValueError(
                f"rope_scaling: unsupported rope_type {self.rope_type!r} "
                "(supported: 'llama3', 'linear', 'yarn')"
            )
        for name in ("factor", "beta_fast", "beta_slow", "attention_factor"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(
                    f"rope_scaling: {name} must be positive, got {getattr(self, name)}"
                )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of the decoder (see the module docstring)."""

    architecture: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int  # V
    hidden_size: int  # E
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # KVH
    head_dim: int  # D
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases
    attention_out_bias: bool = False  # output projection bias (Llama's attention_bias)
    max_position_embeddings: int = 2048
    sliding_window: int | None = None  # the window of the sliding layers
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Per layer: "full_attention" or "sliding_attention". Empty: every layer
    # slides when sliding_window is set (Mistral), else every layer is full.
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # sliding layers' RoPE base, unscaled (Gemma 3)
    norm_offset: float = 0.0  # RMSNorm multiplies by norm_offset + w, in float32 when nonzero
    post_norms: bool = False  # norms of the attention and MLP outputs before the residual add
    qk_norm: bool = False  # RMSNorm of each query and key head (weights [D]) before RoPE
    hidden_act: str = "silu"  # the MLP gate's activation
    embed_scale: bool = False  # embeddings times sqrt(E), rounded to the model dtype
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this); None: head_dim
    attn_logit_softcap: float | None = None  # cap * tanh(scores / cap)
    final_logit_softcap: float | None = None
    attention_sinks: bool = False  # a learned logit per query head (layers.i.sinks [H])
    # Mixture of experts (jaxkv.model.moe); num_experts 0: every layer dense.
    num_experts: int = 0  # X, routed experts of a sparse layer
    num_experts_per_tok: int = 0  # k, experts each token is routed to
    moe_intermediate_size: int = 0  # each routed expert's F
    norm_topk_prob: bool = False  # the k chosen probabilities renormalized to sum to 1
    shared_expert_intermediate_size: int = 0  # F of the sigmoid-gated shared expert; 0: none
    # Per layer: whether its MLP is the mixture (True) or dense (False).
    # Empty: every layer is sparse when num_experts > 0.
    sparse_layers: tuple[bool, ...] = ()
    moe_bias: bool = False  # router [X], gate | up [X, 2Fm] and down [X, E] biases (gpt-oss)
    # Experts' clamped SwiGLU (gpt-oss): gate <= limit, |up| <= limit,
    # (up + 1) * gate * sigmoid(alpha * gate); None: act(gate) * up.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # The checkpoint's fp8 KV scales, one k and one v per layer
    # (layers.i.k_scale, v_scale: value = fp8 * scale), used by fp8 caches.
    kv_cache_scales: bool = False

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        if self.architecture not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"architecture: unknown architecture {self.architecture!r}; "
                f"supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: num_heads ({self.num_heads}) is not a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("rope_theta", "rms_norm_eps"):  # NaN fails every comparison: refused too
            _positive(name, getattr(self, name))
        for name in (
            "rope_local_theta",
            "query_pre_attn_scalar",
            "attn_logit_softcap",
            "final_logit_softcap",
        ):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool)
            or not isinstance(self.sliding_window, int)
            or self.sliding_window <= 0
        ):
            raise ValueError(
                f"sliding_window: must be a positive integer or None, got {self.sliding_window!r}"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types: {len(self.layer_types)} entries for num_layers {self.num_layers}"
                )
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES}, key=str)
            if bad:
                raise ValueError(f"layer_types: unsupported {bad}; supported: {list(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError(
                    "sliding_window: layer_types has sliding layers but no window is set"
                )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act: unsupported {self.hidden_act!r}; supported: {list(ACTIVATIONS)}"
            )
        if not isinstance(self.norm_offset, (int, float)) or self.norm_offset not in (0, 1):
            raise ValueError(f"norm_offset: must be 0 (w) or 1 (1 + w), got {self.norm_offset!r}")
        self._validate_moe()
        for tok in self.eos_token_ids + (
            (self.bos_token_id,) if self.bos_token_id is not None else ()
        ):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ValueError(f"bos/eos token id {tok} outside vocab_size {self.vocab_size}")

    def _validate_moe(self) -> None:
        for name in (
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: must be a non-negative integer, got {value!r}")
        for name in ("norm_topk_prob", "moe_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be true or false, got {getattr(self, name)!r}")
        _positive("swiglu_alpha", self.swiglu_alpha)
        if self.swiglu_limit is not None:
            _positive("swiglu_limit", self.swiglu_limit)
        if any(not isinstance(s, bool) for s in self.sparse_layers):
            raise ValueError(f"sparse_layers: must be booleans, got {list(self.sparse_layers)[:8]}")
        if not self.num_experts:
            for name in (
                "num_experts_per_tok",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
                "moe_bias",
                "swiglu_limit",
            ):
                if getattr(self, name):
                    raise ValueError(f"{name}: set without experts (num_experts is 0)")
            if any(self.sparse_layers):
                raise ValueError("sparse_layers: sparse layers without experts (num_experts is 0)")
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in 1..num_experts ({self.num_experts}), "
                f"got {self.num_experts_per_tok}"
            )
        if not self.moe_intermediate_size:
            raise ValueError("moe_intermediate_size: must be positive when num_experts > 0")
        if self.sparse_layers and len(self.sparse_layers) != self.num_layers:
            raise ValueError(
                f"sparse_layers: {len(self.sparse_layers)} entries for num_layers {self.num_layers}"
            )

    # ------------------------------------------------------------ per layer
    def layer_sparse(self, i: int) -> bool:
        """Whether layer `i`'s MLP is the mixture of experts."""
        return bool(self.num_experts) and (not self.sparse_layers or self.sparse_layers[i])

    def layer_window(self, i: int) -> int | None:
        """Keys a query of layer `i` sees (None: all before it)."""
        if self.sliding_window is None:
            return None
        if not self.layer_types or self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def windows(self) -> tuple[int | None, ...]:
        """layer_window of every layer."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer slides the same one (then pages behind
        it can be freed), else None."""
        ws = set(self.windows)
        return ws.pop() if len(ws) == 1 else None

    @property
    def sm_scale(self) -> float:
        """Attention's score scale."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def rope_scale(self, i: int) -> float:
        """What layer `i` multiplies RoPE's cos and sin by (YaRN's attention
        factor on the layers that rotate with the scaled frequencies)."""
        rs = self.rope_scaling
        return rs.attention_factor if rs is not None and not self.local_rope(i) else 1.0

    def local_rope(self, i: int) -> bool:
        """Whether layer `i` rotates with the sliding layers' own RoPE base."""
        return self.rope_local_theta is not None and self.layer_window(i) is not None

    # --------------------------------------------------------- serialized
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        d["sparse_layers"] = list(self.sparse_layers)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Inverse of `to_dict` (used by jaxkv's own checkpoint format)."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"model config: unknown fields {unknown}")
        if d.get("rope_scaling") is not None:
            if not isinstance(d["rope_scaling"], Mapping):
                raise ValueError(
                    f"rope_scaling: must be an object, got {str(d['rope_scaling'])[:60]}"
                )
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        for name in ("eos_token_ids", "layer_types", "sparse_layers"):
            v = d.get(name, ())
            if not isinstance(v, (list, tuple)):
                raise ValueError(f"{name}: must be a list, got {str(v)[:60]}")
            d[name] = tuple(v)
        return cls(**d)


def _positive(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise ValueError(f"{name}: must be a positive finite number, got {v!r}")
