"""The offline API on a tiny model with a tokenizer and a chat template:
`LLM.generate` and `LLM.chat` against Hugging Face transformers' greedy
decoding and chat-template rendering of the same folder."""

import pytest

from jaxkv import LLM, SamplingParams
from tests.helpers.model_utils import make_hf_model, save_tiny_tokenizer

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf, path = make_hf_model("llama", tmp_path_factory.mktemp("tiny-llm"), eos_token_id=2)
    save_tiny_tokenizer(path)
    llm = LLM(
        str(path),
        warmup=False,
        num_pages=64,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    return hf, path, llm


def hf_greedy(hf, ids, n):
    import torch

    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def test_generate_matches_hf_greedy_in_order_with_an_error_in_place(tiny):
    from transformers import AutoTokenizer

    hf, path, llm = tiny
    hf_tok = AutoTokenizer.from_pretrained(str(path))
    prompts = ["what is a cache", "", "the sky is blue and the sea", {"prompt_token_ids": [7, 9]}]
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert "prompt" in outs[1].error
    for o, p in zip([outs[0], outs[2], outs[3]], [prompts[0], prompts[2], [7, 9]]):
        ids = p if isinstance(p, list) else hf_tok(p)["input_ids"]
        assert o.prompt_token_ids == ids
        assert o.outputs[0].token_ids == hf_greedy(hf, ids, 8)
        assert o.outputs[0].text == hf_tok.decode(o.outputs[0].token_ids)
    # Nothing is left queued: the next call runs only its own prompts.
    assert not llm.engine.has_unfinished_requests()
    again = llm.generate("what is a cache", GREEDY)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_renders_the_template_like_transformers(tiny):
    from transformers import AutoTokenizer

    hf, path, llm = tiny
    hf_tok = AutoTokenizer.from_pretrained(str(path))
    convs = [
        [{"role": "user", "content": "hello world"}],
        [{"role": "system", "content": "yes"}, {"role": "user", "content": "why the sky"}],
    ]
    outs = llm.chat(convs, GREEDY)
    for conv, o in zip(convs, outs):
        text = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        assert o.prompt_token_ids == ids
        assert o.outputs[0].token_ids == hf_greedy(hf, ids, 8)
    one = llm.chat(convs[0], GREEDY)
    assert one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("messages", [5, None, [], "hello", [{"role": "user"}], [[]]])
def test_a_malformed_chat_is_refused_naming_messages(tiny, messages):
    # 5 once raised "'int' object is not subscriptable" (found by scripts/probe/__main__.py)
    with pytest.raises(ValueError, match="^messages: "):
        tiny[2].chat(messages, GREEDY)


def test_a_generate_call_that_fails_leaves_nothing_queued(tiny, monkeypatch):
    _, _, llm = tiny
    real = llm.engine.add_request
    calls = []

    def flaky(prompt, params=None, request_id=None, **options):
        calls.append(prompt)
        if len(calls) == 3:
            raise KeyboardInterrupt  # e.g. Ctrl-C while the list is being queued
        return real(prompt, params, request_id, **options)

    monkeypatch.setattr(llm.engine, "add_request", flaky)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["the sky", "the sea", "a tree", "one two"], GREEDY)
    monkeypatch.setattr(llm.engine, "add_request", real)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(["red blue"], GREEDY)
    assert len(out) == 1 and out[0].outputs[0].finish_reason == "length"
