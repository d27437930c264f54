"""The real model end to end: SmolLM2-135M-Instruct (Q4_1 GGUF) loaded by
jaxkv and by Hugging Face transformers."""

import subprocess
import sys

import numpy as np
import pytest

from jaxkv.runner import SeqInput
from tests.model_utils import nan_cache, step_logits

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Explain paged attention in one sentence."]


@pytest.fixture(scope="module")
def models(smollm2_gguf):
    import torch
    import transformers as tf
    from checkpoints import load_checkpoint
    from jaxkv.model import Llama

    torch.set_num_threads(2)
    hf = tf.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, torch_dtype=torch.float32).eval()
    hf_tok = tf.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    config, params, tok = load_checkpoint(smollm2_gguf)
    return hf, hf_tok, Llama.from_params(config, params), tok


def test_tokenization_logits_and_greedy_tokens_match_hf(models):
    import torch
    hf, hf_tok, model, tok = models
    worst = 0.0
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert ids == hf_tok(prompt)["input_ids"], prompt
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].numpy()
        cache = nan_cache(model.config, 8, 16)
        (got,), _ = step_logits(model, cache, [SeqInput(ids, 0, [3, 1, 6])], 16, rows_per_seq=True)
        err = np.abs(got - want).max()
        worst = max(worst, err)
        assert err <= 1e-3, f"{prompt!r}: max abs logit difference {err:.2e}"
    print(f"max abs logit difference over {len(PROMPTS)} prompts: {worst:.2e}")


def test_32_greedy_tokens_match_hf(models):
    import torch
    from jaxkv.engine import LLMEngine
    from jaxkv.config import EngineConfig
    from jaxkv.sequence import SamplingParams

    hf, hf_tok, model, tok = models
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True),
                     add_special_tokens=False)
    want, past, inp = [], None, torch.tensor([ids])
    with torch.no_grad():  # plain greedy loop: no generation-config rules
        for _ in range(32):
            out = hf(inp, past_key_values=past, use_cache=True)
            past = out.past_key_values
            want.append(int(out.logits[0, -1].argmax()))
            inp = torch.tensor([[want[-1]]])
    eng = LLMEngine(model, tok, EngineConfig(num_pages=16, page_size=16))
    rid = eng.add_request({"prompt_token_ids": ids},
                          SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    got = eng.run_to_completion()[rid].outputs[0].token_ids
    assert got == want
    assert "Paris" in tok.decode(got)


def test_jaxkv_generate_command_answers(tmp_path, smollm2_gguf):
    out = subprocess.run(
        [sys.executable, "-m", "jaxkv.cli", "generate", "What is the capital of France?",
         "--model", str(smollm2_gguf), "--max-tokens", "24", "--max-num-seqs", "4",
         "--kv-cache-memory", str(64 << 20)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout, out.stdout
