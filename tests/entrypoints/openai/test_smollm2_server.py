"""`jaxkv serve` on the default model: chat answers over HTTP, streamed and
not, two clients at once, equal token for token to lone offline runs of the
same conversations."""

from __future__ import annotations

import json
import threading

import jsonschema
import openai
import pytest

from jaxkv.config import EngineConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.entrypoints.openai.server import build_app
from tests.conftest import SMOLLM2_KV_BYTES
from tests.core.test_structured_smollm2 import SCHEMA
from tests.helpers.serve_utils import ThreadServer

CONVERSATIONS = [
    [{"role": "user", "content": "What is a KV cache?"}],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Name a prime number bigger than ten."},
    ],
]


@pytest.mark.slow
def test_served_chat_equals_lone_offline_runs(smollm2):
    module, tok = smollm2
    eng = LLMEngine(module, tok, EngineConfig(kv_cache_memory=SMOLLM2_KV_BYTES, warmup=False))
    want = []
    for msgs in CONVERSATIONS:  # one at a time, before the server owns the engine
        ids = tok.encode(
            tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False
        )
        rid = eng.add_request(
            {"prompt_token_ids": ids}, SamplingParams(max_tokens=24, temperature=0)
        )
        want.append(eng.run_to_completion([rid])[rid].outputs[0].text)
    srv = ThreadServer(build_app(eng, ["smollm2-135m-instruct"]))
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        got: dict = {}

        def ask(i, stream):
            kw = dict(
                model="smollm2-135m-instruct",
                messages=CONVERSATIONS[i],
                max_tokens=24,
                temperature=0,
            )
            if stream:
                got[i, stream] = "".join(
                    ch.choices[0].delta.content or ""
                    for ch in client.chat.completions.create(**kw, stream=True)
                )
            else:
                got[i, stream] = client.chat.completions.create(**kw).choices[0].message.content

        threads = [
            threading.Thread(target=ask, args=(i, s)) for i in range(2) for s in (False, True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        for i in range(2):
            assert got[i, False] == want[i] and got[i, True] == want[i], (i, got, want)
        # Structured outputs through OpenAI's response_format and vLLM's guided_choice.
        r = client.chat.completions.create(
            model="smollm2-135m-instruct",
            temperature=1.0,
            seed=1,
            max_tokens=160,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            },
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        r = client.chat.completions.create(
            model="smollm2-135m-instruct",
            temperature=1.0,
            seed=2,
            max_tokens=8,
            n=4,
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert len(r.choices) == 4 and {c.message.content for c in r.choices} <= {"yes", "no"}
    finally:
        srv.stop()
