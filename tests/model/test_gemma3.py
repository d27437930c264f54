"""Gemma 3 270M (the known model `gemma3-270m`, Q4_K_M GGUF from its four
chunk wheels) end to end against transformers loading the same GGUF:
tokenization, the logits at every position of a prompt, and greedy tokens
through `LLM`; a base model, so `chat` is refused by name."""

from __future__ import annotations

import numpy as np
import pytest

# One xdist worker runs this module: transformers' load of the GGUF (about a
# minute) happens once.
pytestmark = pytest.mark.xdist_group("gemma3")

TEXTS = [
    "The capital of France is",
    "  two  spaces, tabs\tand\nnew lines",
    "naïve café 東京 🙂 1234567",
    "def f(x):\n    return x ** 2  # square",
]


@pytest.fixture(scope="module")
def gguf():
    from checkpoints.known_models import fetch_gemma3_gguf

    return fetch_gemma3_gguf()


@pytest.fixture(scope="module")
def hf(gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.helpers.model_utils import one_gguf_parse

    torch.set_num_threads(2)
    with one_gguf_parse():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        return model, AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_tokens_and_logits_match_transformers(gguf, hf):
    from checkpoints import load_checkpoint
    from jaxkv.model.llama import Llama
    from tests.helpers.model_utils import Seq, hf_logits, nan_cache, step_logits

    model, hf_tok = hf
    config, params, tok = load_checkpoint(gguf)
    assert (
        config.architecture,
        config.num_layers,
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.sliding_window,
        config.vocab_size,
    ) == ("gemma3", 18, 640, 4, 1, 256, 512, 262144)
    assert config.windows.count(None) == 3  # layers 5, 11, 17 are global
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text
    ids = tok.encode(TEXTS[0] + " Paris, and the capital of Japan is")
    want = hf_logits(model, ids)
    (got,), _ = step_logits(
        Llama.from_params(config, params),
        nan_cache(config, 4, 16),
        [Seq(ids, 0, [2, 1, 3])],
        16,
        rows_per_seq=True,
    )
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_greedy_generation_matches_transformers_and_chat_is_refused(hf):
    import torch

    from jaxkv.core.sampling_params import SamplingParams
    from jaxkv.entrypoints.llm import LLM

    model, hf_tok = hf
    # float32 weights, as transformers runs them (the default keeps the GGUF's blocks)
    llm = LLM(
        "gemma3-270m", warmup=False, max_num_seqs=2, num_pages=64, page_size=16, gguf_blocks=False
    )
    for text in TEXTS[:2]:
        ids = hf_tok(text)["input_ids"]
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[
                0, len(ids) :
            ].tolist()
        out = llm.generate(text, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == want, text
    with pytest.raises(ValueError, match="^messages: this model has no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
