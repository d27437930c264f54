"""`jaxkv convert` of a mixture of experts: a transformers Qwen2-MoE folder
(per-expert tensors, a shared expert, a dense layer) to jaxkv's format and
back, the arrays and config unchanged, the printed counts against
transformers' own parameter count."""

from __future__ import annotations

import numpy as np

from checkpoints import load_checkpoint
from checkpoints.safetensors_io import load_hf_dir
from jaxkv.entrypoints.cli import main as cli_main
from tests.model.test_moe import _hf_model, _saved


def test_convert_moe_round_trip_and_counts(tmp_path, capsys):
    model = _hf_model("qwen2_moe")
    src = _saved(model, tmp_path / "hf")
    config, params = load_hf_dir(src)
    assert cli_main(["convert", str(src), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    config2, back, _ = load_checkpoint(tmp_path / "out")
    assert config2 == config and config2.num_experts == 8
    assert set(back) == set(params)
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])
    total = sum(p.numel() for p in model.parameters())
    experts = sum(
        p.numel() for n, p in model.named_parameters() if ".experts." in n and "shared" not in n
    )
    # Active: all but the experts, plus k of the 8 experts' share.
    active = total - experts + experts // 8 * 2
    assert f"{total:,} parameters, {experts:,} in 8 experts, {active:,} active per token" in printed
