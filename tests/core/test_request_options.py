"""Request options on a tiny random model: n > 1 sharing the prompt's pages
(each answer equal to a lone n = 1 run with that answer's seed), logit
bias / allowed tokens / bad words against a numpy oracle over Hugging Face
logits, prompt log-probabilities against transformers' log-softmax."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.core.engine import LLMEngine
from jaxkv.core.requests import child_seed
from jaxkv.core.sampling_params import SamplingParams
from tests.helpers.model_utils import WORDS, hf_logits, make_hf_model, save_tiny_tokenizer

PS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch_model, path = make_hf_model("llama", tmp_path_factory.mktemp("tiny"))
    save_tiny_tokenizer(path)
    return torch_model, path


def _engine(tiny, **kw):
    opts = dict(num_pages=128, page_size=PS, max_num_seqs=16, warmup=False)
    return LLMEngine.from_pretrained(str(tiny[1]), **{**opts, **kw})


def _run(eng, prompt, **params):
    rid = eng.add_request(prompt, SamplingParams(**params))
    return eng.run_to_completion([rid])[rid]


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


LONG = " ".join(WORDS[:41])  # 42 tokens with BOS: 5 full pages of 8 before the last token


def test_n_prefills_once_shares_full_pages_and_equals_lone_runs(tiny):
    eng = _engine(tiny)
    rid = eng.add_request(
        LONG, SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    )
    parent = eng.get_request(rid)
    prompt_len = len(parent.prompt_token_ids)
    most_sharing = 0
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            final = o if o.finished else final
        if rid in eng.bm:
            first_page = eng.bm.block_table(rid)[0]
            most_sharing = max(most_sharing, eng.bm.refcount(first_page))
    assert most_sharing == 8  # the prompt's full pages are held once, by all 8
    # The prompt minus its last token once, then each answer's last token.
    assert eng.stats["prompt_tokens_computed"] == prompt_len - 1 + 8
    assert [c.index for c in final.outputs] == list(range(8))
    texts = [c.token_ids for c in final.outputs]
    assert len({tuple(t) for t in texts}) == 8  # temperature 1: all differ
    lone = _engine(tiny)
    for i, c in enumerate(final.outputs):
        ref = _run(
            lone, LONG, temperature=1.0, seed=child_seed(3, i), max_tokens=8, ignore_eos=True
        )
        assert c.token_ids == ref.outputs[0].token_ids, i
    again = _run(_engine(tiny), LONG, n=8, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    assert [c.token_ids for c in again.outputs] == texts


def test_greedy_n_equals_n_1_and_short_prompts_and_abort(tiny):
    eng = _engine(tiny)
    one = _run(eng, LONG, max_tokens=6, temperature=0)
    four = _run(eng, LONG, n=4, max_tokens=6, temperature=0)
    assert [c.token_ids for c in four.outputs] == [one.outputs[0].token_ids] * 4
    short = _run(eng, "the sky", n=3, max_tokens=5, temperature=0)  # no full page to share
    assert len({tuple(c.token_ids) for c in short.outputs}) == 1
    assert (
        short.outputs[0].token_ids
        == _run(eng, "the sky", max_tokens=5, temperature=0).outputs[0].token_ids
    )
    rid = eng.add_request(LONG, SamplingParams(n=5, max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    eng.abort(rid)
    outs = [o for o in eng.step() if o.request_id == rid]
    assert outs[0].finished and {c.finish_reason for c in outs[0].outputs} == {"abort"}
    assert not eng.has_unfinished_requests() and eng.bm.num_used_pages == 0


def test_n_under_preemption_still_equals_lone_runs(tiny):
    small = _engine(tiny, num_pages=24, max_num_seqs=4)
    out = _run(small, LONG, n=4, temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    assert small.scheduler.num_preemptions > 0
    lone = _engine(tiny)
    for i, c in enumerate(out.outputs):
        ref = _run(
            lone, LONG, temperature=1.0, seed=child_seed(11, i), max_tokens=40, ignore_eos=True
        )
        assert c.token_ids == ref.outputs[0].token_ids, i


def _greedy_oracle(torch_model, prompt_ids, steps, adjust):
    """Greedy tokens with `adjust(logits row, tokens so far) -> logits row`
    applied to transformers' logits at each step."""
    toks = list(prompt_ids)
    out = []
    for _ in range(steps):
        row = adjust(hf_logits(torch_model, toks)[-1].astype(np.float64), out)
        t = int(np.argmax(row))
        out.append(t)
        toks.append(t)
    return out


def test_logit_bias_allowed_tokens_and_bad_words_match_numpy(tiny):
    torch_model, _ = tiny
    eng = _engine(tiny)
    ids = eng.tokenizer.encode("what is the cache")
    n = 10
    base = _run(eng, {"prompt_token_ids": ids}, max_tokens=n, temperature=0, ignore_eos=True)
    b0, b1 = base.outputs[0].token_ids[:2]
    bias = {b0: -5.0, 40: 4.0, str(41): 2.5}

    def with_bias(row, _):
        row = row.copy()
        for t, v in bias.items():
            row[int(t)] += v
        return row

    got = (
        _run(
            eng,
            {"prompt_token_ids": ids},
            max_tokens=n,
            temperature=0,
            ignore_eos=True,
            logit_bias=bias,
        )
        .outputs[0]
        .token_ids
    )
    assert got == _greedy_oracle(torch_model, ids, n, with_bias)
    allowed = [7, 9, 30, 31, 50, 77]

    def only(row, _):
        keep = np.full_like(row, -np.inf)
        keep[allowed] = row[allowed]
        return keep

    got = (
        _run(
            eng,
            {"prompt_token_ids": ids},
            max_tokens=n,
            temperature=0,
            ignore_eos=True,
            allowed_token_ids=allowed,
        )
        .outputs[0]
        .token_ids
    )
    assert got == _greedy_oracle(torch_model, ids, n, only)
    sampled = (
        _run(
            eng,
            {"prompt_token_ids": ids},
            max_tokens=30,
            temperature=1.0,
            seed=1,
            ignore_eos=True,
            allowed_token_ids=allowed,
        )
        .outputs[0]
        .token_ids
    )
    assert set(sampled) <= set(allowed)
    # bad_words: single-word bans (the tiny tokenizer has one token per word)
    words = [eng.tokenizer.decode([b0]), eng.tokenizer.decode([b1])]

    def banned(row, _):
        row = row.copy()
        row[[b0, b1]] = -np.inf
        return row

    got = (
        _run(
            eng,
            {"prompt_token_ids": ids},
            max_tokens=n,
            temperature=0,
            ignore_eos=True,
            bad_words=words,
        )
        .outputs[0]
        .token_ids
    )
    assert got == _greedy_oracle(torch_model, ids, n, banned)
    assert b0 not in got and b1 not in got


def test_two_token_bad_word_bans_only_after_its_start(tiny):
    torch_model, _ = tiny
    eng = _engine(tiny)
    ids = eng.tokenizer.encode("hello world how")
    base = (
        _run(eng, {"prompt_token_ids": ids}, max_tokens=8, temperature=0, ignore_eos=True)
        .outputs[0]
        .token_ids
    )
    first, second = base[0], base[1]
    phrase = eng.tokenizer.decode([first, second])

    def ban_pair(row, out):
        row = row.copy()
        if out and out[-1] == first:
            row[second] = -np.inf
        return row

    got = (
        _run(
            eng,
            {"prompt_token_ids": ids},
            max_tokens=8,
            temperature=0,
            ignore_eos=True,
            bad_words=[phrase],
        )
        .outputs[0]
        .token_ids
    )
    assert got == _greedy_oracle(torch_model, ids, 8, ban_pair)
    assert got[0] == first and got[1] != second


def test_prompt_logprobs_match_transformers_with_and_without_a_cache_hit(tiny):
    torch_model, _ = tiny
    eng = _engine(tiny, max_num_batched_tokens=64)
    ids = eng.tokenizer.encode(" ".join(WORDS[:30]) + " " + " ".join(WORDS[:30]))  # 61 tokens
    lp = _log_softmax(hf_logits(torch_model, ids).astype(np.float64))
    _run(eng, {"prompt_token_ids": ids}, max_tokens=2)  # caches the prompt's pages
    for _attempt in range(2):
        out = _run(
            eng,
            {"prompt_token_ids": ids},
            max_tokens=3,
            temperature=0,
            prompt_logprobs=3,
            logprobs=1,
        )
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(ids) and plp[0] is None
        for pos in range(1, len(ids)):
            e = plp[pos]
            assert e.token_id == ids[pos]
            assert e.logprob == pytest.approx(lp[pos - 1, ids[pos]], abs=1e-4)
            assert sorted(e.top.values(), reverse=True) == pytest.approx(
                np.sort(lp[pos - 1])[::-1][:3], abs=1e-4
            )
        assert out.num_cached_tokens == 0  # recomputed, not served from the cache
        ref = _run(eng, {"prompt_token_ids": ids}, max_tokens=3, temperature=0)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
