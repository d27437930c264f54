"""The real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF) loaded by
jaxkv and by Hugging Face transformers."""

import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import SMOLLM2_KV_BYTES, SMOLLM2_PAGES
from tests.helpers.model_utils import Seq, nan_cache, step_logits

# With tests/checkpoints/test_smollm2_weights.py on one xdist worker: transformers'
# SmolLM2 load (the session fixture hf_smollm2) happens once.
pytestmark = pytest.mark.xdist_group("hf_smollm2")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Explain paged attention in one sentence.",
]


def test_tokenization_and_logits_match_hf(smollm2, hf_smollm2, smollm2_gguf):
    import torch
    from transformers import AutoTokenizer

    model, tok = smollm2
    hf_tok = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    ids = [tok.encode(p) for p in PROMPTS]
    assert ids == [hf_tok(p)["input_ids"] for p in PROMPTS]
    # All prompts in one ragged step, pages scrambled, unused pages NaN.
    tables = [[7, 2], [5, 11], [3, 9, 1]]
    cache = nan_cache(model.config, 12, 16)
    got, _ = step_logits(
        model, cache, [Seq(x, 0, t) for x, t in zip(ids, tables)], 16, rows_per_seq=True
    )
    worst = 0.0
    for prompt, x, g in zip(PROMPTS, ids, got):
        with torch.no_grad():
            want = hf_smollm2(torch.tensor([x])).logits[0].numpy()
        err = float(np.abs(g - want).max())
        worst = max(worst, err)
        assert err <= 1e-3, f"{prompt!r}: max abs logit difference {err:.2e}"
    print(f"max abs logit difference over {len(PROMPTS)} prompts: {worst:.2e}")


def test_32_greedy_tokens_match_hf(smollm2, hf_smollm2):
    import torch

    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine
    from jaxkv.core.sampling_params import SamplingParams

    model, tok = smollm2
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.encode(
        tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False
    )
    want, past, inp = [], None, torch.tensor([ids])
    with torch.no_grad():  # plain greedy loop: no generation-config rules
        for _ in range(32):
            out = hf_smollm2(inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            want.append(int(out.logits[0, -1].argmax()))
            inp = torch.tensor([[want[-1]]])
    eng = LLMEngine(
        model,
        tok,
        EngineConfig(
            warmup=False, num_pages=SMOLLM2_PAGES, max_num_seqs=8, max_num_batched_tokens=64
        ),
    )
    rid = eng.add_request(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    )
    got = eng.run_to_completion()[rid].outputs[0].token_ids
    assert got == want
    assert "Paris" in tok.decode(got)


def test_jaxkv_generate_command_answers(smollm2_gguf):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxkv",
            "generate",
            "What is the capital of France?",
            "--model",
            str(smollm2_gguf),
            "--max-tokens",
            "24",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "64",
            "--kv-cache-memory",
            str(SMOLLM2_KV_BYTES),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout, out.stdout
