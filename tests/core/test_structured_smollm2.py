"""Structured outputs on the default model: sampled at temperature 1, every
answer parses and validates (the `jsonschema` library), matches the regex
or is one of the choices; an unconstrained request in the same batch is
token for token its lone run; a second round with new grammars compiles
nothing."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxkv.config import EngineConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from tests.conftest import SMOLLM2_KV_BYTES
from tests.helpers.compile_count import count_compiles

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "address"],
    "additionalProperties": False,
}


def _chat(tok, text):
    return {
        "prompt_token_ids": tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
    }


@pytest.mark.slow
def test_schema_regex_and_choice_hold_at_temperature_1(smollm2):
    module, tok = smollm2
    eng = LLMEngine(module, tok, EngineConfig(kv_cache_memory=SMOLLM2_KV_BYTES, warmup=False))
    free_prompt = _chat(tok, "Name three colors.")
    rid = eng.add_request(free_prompt, SamplingParams(max_tokens=16, temperature=0))
    lone = eng.run_to_completion([rid])[rid].outputs[0].token_ids

    person = _chat(tok, "Describe a person as JSON.")
    ids = [
        eng.add_request(
            person,
            SamplingParams(
                max_tokens=160, temperature=1.0, seed=i, structured_outputs={"json": SCHEMA}
            ),
        )
        for i in range(32)
    ]
    free = eng.add_request(free_prompt, SamplingParams(max_tokens=16, temperature=0))
    outs = eng.run_to_completion(ids + [free])
    assert outs[free].outputs[0].token_ids == lone
    for i in ids:
        c = outs[i].outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMA)

    with count_compiles() as compiles:  # new grammars, same programs
        phone = _chat(tok, "Give me a phone number.")
        regex = [
            eng.add_request(
                phone,
                SamplingParams(
                    max_tokens=20,
                    temperature=1.0,
                    seed=i,
                    structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4}"},
                ),
            )
            for i in range(10)
        ]
        choice = [
            eng.add_request(
                _chat(tok, "Is the sky blue?"),
                SamplingParams(
                    max_tokens=8,
                    temperature=1.0,
                    seed=i,
                    structured_outputs={"choice": ["yes", "no", "it depends"]},
                ),
            )
            for i in range(10)
        ]
        outs = eng.run_to_completion(regex + choice)
    assert compiles == []
    for i in regex:
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", outs[i].outputs[0].text), outs[i]
    for i in choice:
        assert outs[i].outputs[0].text in ("yes", "no", "it depends"), outs[i]


@pytest.mark.slow
def test_bad_grammars_are_named_errors(smollm2):
    module, tok = smollm2
    eng = LLMEngine(module, tok, EngineConfig(kv_cache_memory=SMOLLM2_KV_BYTES, warmup=False))
    bad = [
        {"regex": "(unclosed"},
        {"grammar": "start: undefined_rule"},
        {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
        {"json": "{not json"},
        {"choice": []},
        {"regex": "a", "choice": ["b"]},
        "json",
        {"choice": [f"c{i}" for i in range(10_001)]},
        # 2,001 literals in one rule: too many parser items after one token
        # (once accepted, then a 23 KB error after the answer's first token)
        {
            "grammar": "start: "
            + " | ".join(
                json.dumps(f"{w} {i}")
                for i, w in enumerate(["apple", "river", "stone", "cloud"] * 501)
            )
        },
    ]
    for spec in bad:
        rid = eng.add_request("hi", SamplingParams(max_tokens=4, structured_outputs=spec))
        out = eng.run_to_completion([rid])[rid]
        assert out.outputs[0].finish_reason == "error", spec
        assert out.error.startswith("structured_outputs:"), (spec, out.error)
        assert out.outputs[0].token_ids == [] and len(out.error) < 500, out.error
    # The same 2,001 answers as a choice list run (one regex), at temperature 1.
    choices = [f"{w} {i}" for i, w in enumerate(["apple", "river", "stone", "cloud"] * 501)][:2001]
    rids = [
        eng.add_request(
            _chat(tok, "Pick one."),
            SamplingParams(
                max_tokens=12, temperature=1.0, seed=i, structured_outputs={"choice": choices}
            ),
        )
        for i in range(4)
    ]
    outs = eng.run_to_completion(rids)
    for r in rids:
        assert outs[r].error is None and outs[r].outputs[0].text in choices, outs[r].outputs[0]
