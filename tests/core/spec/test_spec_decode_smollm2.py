"""Speculative decoding on the real model: SmolLM2-135M-Instruct's greedy
answers to 8 chat prompts, batched with chunked prefill, prefix caching
and preemption, are the same tokens with n-gram speculation as without;
with the model as its own draft too, where nearly every proposal must be
accepted."""

import pytest

from jaxkv.config import EngineConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams

PASSAGE = (
    "The harbour town woke before the sun. Fishermen checked their nets by lamplight, "
    "counting knots and mending the places where the sea had chewed through the twine."
)
ASKS = [
    "Repeat this text exactly: ",
    "Rewrite in the present tense: ",
    "Replace 'harbour' with 'port' in: ",
    "Summarize in one sentence: ",
    "What is a KV cache?",
    "Write a haiku about the sea.",
    "Explain photosynthesis briefly.",
    "List three prime numbers.",
]


# One xdist worker runs this module: both tests read the plain answers.
pytestmark = pytest.mark.xdist_group("spec_smollm2")


def _prompts(tok, n):
    out = []
    for i in range(n):
        ask = ASKS[i % len(ASKS)]
        text = ask + (PASSAGE if ask.endswith(": ") else "") + f" (request {i // len(ASKS)})"
        msgs = [{"role": "user", "content": text}]
        out.append(
            tok.encode(
                tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False
            )
        )
    return out


def _run(model, tok, prompts, spec, draft=None, max_tokens=16):
    eng = LLMEngine(
        model,
        tok,
        EngineConfig(
            warmup=False,
            num_pages=24,
            page_size=16,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            speculative_config=spec,
        ),
        draft_model=draft,
    )
    ids = [
        eng.add_request(
            {"prompt_token_ids": p}, SamplingParams(max_tokens=max_tokens, temperature=0)
        )
        for p in prompts
    ]
    final = eng.run_to_completion()
    return eng, [final[r].outputs[0].token_ids for r in ids]


@pytest.fixture(scope="module")
def plain(smollm2):
    """The prompts and their greedy answers without speculation."""
    model, tok = smollm2
    prompts = _prompts(tok, 8)
    return prompts, _run(model, tok, prompts, None)[1]


def test_ngram_keeps_smollm2s_greedy_answers(smollm2, plain):
    model, tok = smollm2
    prompts, want = plain
    eng, spec = _run(
        model, tok, prompts, {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    )
    assert eng.scheduler.num_preemptions > 0, "no preemption happened"
    assert eng.bm.prefix_hit_tokens > 0 and eng.stats["partial_prefills"] > 0
    m = eng.speculative_metrics()
    assert m["accepted"] > 5, m  # 11 of 32 on this greedy run
    diff = [i for i, (a, b) in enumerate(zip(want, spec)) if a != b]
    assert not diff, f"requests {diff} differ with n-gram speculation"
    print(f"n-gram on SmolLM2: {m}")


def test_self_draft_keeps_smollm2s_greedy_answers(smollm2, plain):
    model, tok = smollm2
    prompts, want = plain
    eng, own = _run(
        model,
        tok,
        prompts,
        {"method": "draft_model", "model": "self", "num_speculative_tokens": 3, "adaptive": False},
        draft=model,
    )
    m = eng.speculative_metrics()
    assert own == want
    # One-row draft steps and the multi-row verify step round differently,
    # so a near-tie may flip; anything below 97% is a broken draft cache.
    assert m["proposed"] > 50 and m["acceptance_rate"] >= 0.97, m
    print(f"SmolLM2 as its own draft: {m}")
