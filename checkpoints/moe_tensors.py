"""Hugging Face names of a sparse layer's tensors (`jaxkv.model.moe`) and
how each lands in jaxkv's stacked params (`jaxkv.model.params.moe_shapes`).

Checkpoints keep the experts in one of two layouts, both read here, chosen
per layer by the names present:

- per expert (what transformers 5 `save_pretrained` writes by default, and
  every 4.x save): ``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight``
  (Qwen), ``block_sparse_moe.experts.{j}.w1/w3/w2.weight`` (Mixtral), each
  [Fm, E] or [E, Fm]; X of them stack into one param (a many-to-one map);
- fused (transformers 5's own layout, `save_original_format=False`):
  ``mlp.experts.gate_up_proj`` [X, 2Fm, E] and ``mlp.experts.down_proj``
  [X, E, Fm].

The router is ``mlp.gate.weight`` (Mixtral per expert:
``block_sparse_moe.gate.weight``) [X, E]; Qwen2-MoE's shared expert
``mlp.shared_expert.{gate,up,down}_proj.weight`` and its gate
``mlp.shared_expert_gate.weight`` [1, E].

gpt-oss keeps its experts fused and [in, out] already, with biases:
``mlp.experts.gate_up_proj`` [X, E, 2Fm] whose gate and up columns
alternate (gate at even, up at odd indices; split into jaxkv's gate | up
halves here, its bias ``gate_up_proj_bias`` [X, 2Fm] too),
``mlp.experts.down_proj`` [X, Fm, E], ``down_proj_bias`` [X, E], and the
router ``mlp.router.weight`` [X, E] with ``mlp.router.bias`` [X]. Its
MXFP4 checkpoints' ``*_blocks`` / ``*_scales`` pairs arrive here already
dequantized (`checkpoints.mxfp4`). A missing expert tensor, or one
not in the table (an expert index past X), is an error naming it
(`checkpoints.safetensors_io.hf_to_params`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np

from jaxkv.config import ModelConfig
from jaxkv.model.params import moe_shapes


@dataclasses.dataclass(frozen=True)
class Into:
    """How one HF tensor lands in its jaxkv param: "T" transposed; "row"
    [1, E] -> [E]; "stack" a fused [X, out, in] -> [X, in, out]; "copy" as
    it is; "deinterleave" [..., 2Fm] alternating gate, up -> gate | up; or expert
    `expert`'s slice of a stacked param: "gate" / "up" (the halves of
    experts_gate_up's last axis) or "down", each transposed."""

    kind: str
    expert: int | None = None

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF shape of the tensor whose jaxkv param has `shape`."""
        if self.kind == "T":
            return shape[::-1]
        if self.kind == "row":
            return (1,) + shape
        if self.kind == "stack":
            return (shape[0], shape[2], shape[1])
        if self.kind in ("copy", "deinterleave"):
            return shape
        if self.kind in ("gate", "up"):  # [X, E, 2Fm] <- [Fm, E] each
            return (shape[2] // 2, shape[1])
        return (shape[2], shape[1])  # down: [X, Fm, E] <- [E, Fm]

    def put(self, params: dict, name: str, w: np.ndarray, shape: tuple[int, ...], dtype) -> None:
        """Write HF tensor `w` into params[name] (allocated on first use)."""
        if name not in params:  # a fresh C-order array: sources may be memory-mapped
            params[name] = np.empty(shape, dtype)
        out = params[name]
        if self.kind in ("gate", "up"):
            F = shape[2] // 2
            out = out[self.expert, :, :F] if self.kind == "gate" else out[self.expert, :, F:]
        elif self.kind == "down":
            out = out[self.expert]
        src = {
            "row": lambda: w.reshape(-1),
            "stack": lambda: w.transpose(0, 2, 1),
            "copy": lambda: w,
            "deinterleave": lambda: np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1),
        }.get(self.kind, lambda: w.T)()
        np.copyto(out, src, casting="unsafe")


def hf_moe_map(
    config: ModelConfig, names: Iterable[str] = ()
) -> dict[str, tuple[str, Into, tuple[int, ...]]]:
    """HF name -> (jaxkv name, Into, expected HF shape) of every sparse
    layer's tensor; a layer is read fused when ``names`` (the checkpoint's)
    holds its ``mlp.experts.gate_up_proj``, per expert otherwise."""
    names = set(names)
    mixtral = config.architecture == "mixtral"
    table: dict[str, tuple[str, Into, tuple[int, ...]]] = {}
    for i in range(config.num_layers):
        if not config.layer_sparse(i):
            continue
        p, q = f"model.layers.{i}.", f"layers.{i}."
        want = moe_shapes(config, q)
        fused = p + "mlp.experts.gate_up_proj" in names
        moe = p + ("block_sparse_moe." if mixtral and not fused else "mlp.")
        entries = [(moe + "gate.weight", "router", Into("T"))]
        if config.architecture == "gpt_oss":
            entries = [
                (moe + "router.weight", "router", Into("T")),
                (moe + "router.bias", "router_bias", Into("copy")),
                (moe + "experts.gate_up_proj", "experts_gate_up", Into("deinterleave")),
                (moe + "experts.gate_up_proj_bias", "experts_gate_up_bias", Into("deinterleave")),
                (moe + "experts.down_proj", "experts_down", Into("copy")),
                (moe + "experts.down_proj_bias", "experts_down_bias", Into("copy")),
            ]
        elif fused:
            entries += [
                (moe + "experts.gate_up_proj", "experts_gate_up", Into("stack")),
                (moe + "experts.down_proj", "experts_down", Into("stack")),
            ]
        else:
            parts = (
                (("w1", "gate"), ("w3", "up"), ("w2", "down"))
                if mixtral
                else (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"))
            )
            entries += [
                (
                    f"{moe}experts.{j}.{hf}.weight",
                    "experts_down" if part == "down" else "experts_gate_up",
                    Into(part, j),
                )
                for j in range(config.num_experts)
                for hf, part in parts
            ]
        if config.shared_expert_intermediate_size:
            entries += [
                (f"{moe}shared_expert.{hf}_proj.weight", f"shared_w_{hf}", Into("T"))
                for hf in ("gate", "up", "down")
            ]
            entries.append((moe + "shared_expert_gate.weight", "shared_expert_gate", Into("row")))
        for hf, name, into in entries:
            table[hf] = (q + name, into, into.hf_shape(want[q + name]))
    return table
