"""The Responses API (`jaxkv.entrypoints.openai.responses_api`) with the
real `openai` client on the tool tests' model (random weights, SmolLM2's
tokenizer): `responses.create` equal to the chat completion it means,
`responses.stream` events rebuilding the same response, function tools
forced and their output sent back, `previous_response_id` chains reusing
their prefix pages, GET / DELETE, `store: false`, and refusals by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers.serve_utils import post
from tests.helpers.tool_cases import SCHEMAS, WEATHER

FN = [{"type": "function", "name": "get_weather", "description": "Forecast", "parameters": WEATHER}]


# Compact JSON (llguidance's x-guidance field): a random model would wander in free whitespace.
OK = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}


def test_create_equals_the_chat_completion_and_the_stream_rebuilds_it(client):
    """Held to a JSON schema (text.format), so the answer ends before its budget."""
    kw = dict(
        model="tiny",
        input="what is the cache",
        instructions="Be brief.",
        max_output_tokens=40,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "a", "schema": OK}},
    )
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(
        model="tiny",
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": OK}},
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "what is the cache"},
        ],
    )
    assert r.status == "completed" and chat.choices[0].finish_reason == "stop"
    assert r.output_text == chat.choices[0].message.content
    jsonschema.validate(json.loads(r.output_text), OK)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    kinds = []
    with client.responses.stream(**kw) as stream:
        for ev in stream:
            kinds.append(ev.type)
        final = stream.get_final_response()
    assert final.output_text == r.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    assert client.responses.retrieve(final.id).output_text == r.output_text
    # Out of budget: incomplete, and why.
    cut = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_forced_function_call_its_output_sent_back_and_a_chain(client, server):
    r = client.responses.create(
        model="tiny",
        input="weather in Paris?",
        tools=FN,
        temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=80,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    # Streamed: the call's events rebuild the same call.
    with client.responses.stream(
        model="tiny",
        input="weather in Paris?",
        tools=FN,
        temperature=0,
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_output_tokens=80,
    ) as stream:
        final = stream.get_final_response()
    fc = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in fc] == [(c.name, c.arguments) for c in calls]
    # The call's output sent back on the chain: the conversation so far comes first.
    r2 = client.responses.create(
        model="tiny",
        previous_response_id=r.id,
        tools=FN,
        temperature=0,
        max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}],
    )
    assert r2.previous_response_id == r.id and r2.status in ("completed", "incomplete")
    r3 = client.responses.create(
        model="tiny",
        previous_response_id=r2.id,
        input="and tomorrow?",
        tools=FN,
        max_output_tokens=4,
        temperature=0,
    )
    assert r3.usage.input_tokens > r2.usage.input_tokens > r.usage.input_tokens
    # Each turn finds the pages of the one before (the same rendered prefix).
    assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens // 16 * 16 - 16
    # store: false is not kept; DELETE forgets; unknown ids are 404s naming the field.
    r4 = client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r4.id)
    client.responses.delete(r3.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r3.id)
    status, body = post(
        server.port, "/v1/responses", {"model": "tiny", "input": "x", "previous_response_id": r3.id}
    )
    assert status == 404 and body["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "edit, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": []}, "input"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"tools": FN, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"max_output_tokens": "many"}, "max_completion_tokens"),
    ],
)
def test_unsupported_or_bad_fields_are_named(server, client, edit, param):
    status, body = post(server.port, "/v1/responses", {"model": "tiny", "input": "hi", **edit})
    assert status in (400, 404) and body["error"]["param"] == param, body
    assert (
        client.responses.create(model="tiny", input="hi", max_output_tokens=2).status
        == "incomplete"
    )
