"""Tool calling on /v1/chat/completions (`jaxkv.entrypoints.openai.tools`)
with the real `openai` client, on a random 2-layer model that has SmolLM2's
real tokenizer and chat template (which does not render tools: the
documented fallback): forced calls (named, required, parallel) whose
arguments validate against their schemas, streamed deltas reassembling to
the non-streamed call, a tool result sent back and answered, bad tool
fields answered 400 naming the field while the server goes on; the parsers
on scripted answers ("auto"); the OpenAI Agents SDK's loop; reasoning
(`<think>`, written by a regex the answer is held to) in reasoning_content."""

from __future__ import annotations

import json
from typing import Annotated, Literal  # noqa: F401 - the agent's tool signature (postponed annotations)

import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel, Field

from jaxkv.entrypoints.openai import tools as T
from jaxkv.entrypoints.openai.protocol import chat_messages
from jaxkv.entrypoints.openai.tool_stream import StreamParser
from scripts.probe.serve_hostile import CHAIN
from tests.helpers.serve_utils import post
from tests.helpers.tool_cases import ASK, SCHEMAS, TOOLS


def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_named_tool_choice_forces_a_valid_call_and_the_stream_reassembles_to_it(client):
    kw = dict(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=120,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert len(ch.message.tool_calls) == 1
    _check_calls(ch.message.tool_calls, {"get_weather"})
    # Streamed: the call's id and name first, then its arguments; the same call.
    calls, order, finish = {}, [], None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            e = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                order.append("id")
                e["id"], e["name"] = tc.id, tc.function.name
            if tc.function and tc.function.arguments:
                order.append("arguments")
                e["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and order[0] == "id" and list(calls) == [0]
    want = ch.message.tool_calls[0].function
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == (
        want.name,
        json.loads(want.arguments),
    )


def test_required_may_call_several_tools_each_valid(client):
    done = 0
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            max_tokens=200,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
        )
        ch = r.choices[0]
        if ch.finish_reason == "length":  # a random model may keep calling past the budget
            continue
        assert ch.finish_reason == "tool_calls"
        _check_calls(ch.message.tool_calls, set(SCHEMAS))
        done += 1
    assert done


def test_a_tool_result_sent_back_is_rendered_and_answered(server, client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})},
    }
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 0
    # What the model read: the fallback's tool list, the call and its result.
    msgs2, _ = T.for_template(chat_messages({"messages": msgs}), None, native=False)
    assert msgs2[1]["content"].startswith('<tool_call>\n{"name": "get_weather"')
    assert msgs2[2] == {"role": "user", "content": "<tool_response>\nsunny, 21 C\n</tool_response>"}


@pytest.mark.parametrize(
    "edit, param",
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "nonsense"}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        (
            {
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "type": "function",
                                "function": {"name": "get_time", "arguments": "{not json"},
                            }
                        ],
                    }
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(server, client, edit, param):
    status, body = post(
        server.port,
        "/v1/chat/completions",
        {"model": "tiny", "messages": ASK, "max_tokens": 2, **edit},
    )
    assert status == 400 and body["error"]["param"] == param, body
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def _tools(parser="hermes", parallel=True):
    return T.check_tools({"tools": TOOLS, "parallel_tool_calls": parallel}, parser)


def test_auto_parses_what_the_model_wrote():
    text = (
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    content, calls = T.parse(text, _tools())
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Lima", "days": 2}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert len(T.parse(text, _tools(parallel=False))[1]) == 1
    # Not a call: broken JSON, an unknown function: content, never an error.
    for bad in (
        '<tool_call>{"name": "get_weather", </tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        "plain words",
    ):
        assert T.parse(bad, _tools()) == (bad, [])
    content, calls = T.parse(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}',
        _tools("llama3_json"),
    )
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert T.parse('{"name": "get_time"} is JSON', _tools("llama3_json"))[1] == []


def test_the_stream_parser_holds_back_only_what_may_be_a_call():
    text = (
        'Sure <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> and <to'
        'ol maybe> <tool_call>{"broken</tool_call> done'
    )
    want_content, want_calls = T.parse(text, _tools())
    for step in (1, 3, 7, len(text)):
        p = StreamParser(_tools())
        content, deltas = "", []
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        for j, piece in enumerate(pieces):
            c, d = p.feed(piece, j == len(pieces) - 1)
            content += c
            deltas += d
        assert " ".join(content.split()) == " ".join(want_content.split())
        assert [d["function"]["name"] for d in deltas if "id" in d] == ["get_time"]
        assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"zone": "UTC"}
    assert len(want_calls) == 1


def test_the_openai_agents_sdk_runs_its_loop_against_the_server(server):
    """The OpenAI Agents SDK's own Runner, its chat-completions model pointed
    at the server: the forced call reaches the Python function, whose
    return value ends the run (deterministic: a forced choice, greedy)."""
    import asyncio

    set_tracing_disabled(True)  # nothing leaves this machine
    seen = []

    @function_tool
    def get_weather(
        city: Literal["Paris", "Tokyo"], days: Annotated[int, Field(ge=1, le=7)]
    ) -> str:
        """The forecast for a city."""
        seen.append((city, days))
        return f"sunny in {city} for {days} days"

    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    agent = Agent(
        name="forecaster",
        instructions="Answer with the tools.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=64),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(seen) == 1 and seen[0][0] in ("Paris", "Tokyo") and 1 <= seen[0][1] <= 7
    assert result.final_output == f"sunny in {seen[0][0]} for {seen[0][1]} days"


class _Item(BaseModel):
    name: Literal["tea", "cake"]
    qty: Annotated[int, Field(ge=1, le=9)]


class _Order(BaseModel):
    items: Annotated[list[_Item], Field(min_length=1, max_length=2)]
    gift: _Item | None = None


def test_pydantic_defs_schemas_are_forced_and_their_arguments_validate(server, client):
    """The Agents SDK's Pydantic schemas keep their `$defs` (the forced
    call's grammar resolves them against the tool's own schema, not the
    call wrapper): its Runner gets a call its own model parses, and the
    arguments validate against the schema it sent; a schema that refers to
    itself ("$ref": "#") gives arguments of that schema."""
    import asyncio

    from agents.function_schema import function_schema

    set_tracing_disabled(True)
    seen = []

    def place_order(order: _Order) -> str:
        """Place an order."""
        seen.append(order)
        return "placed"

    schema = function_schema(place_order).params_json_schema
    assert "$defs" in json.dumps(schema)
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    agent = Agent(
        name="shop",
        instructions="Order with the tools.",
        tools=[function_tool(place_order)],
        model=OpenAIChatCompletionsModel(model="tiny", openai_client=aclient),
        model_settings=ModelSettings(tool_choice="place_order", temperature=0, max_tokens=96),
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "Two teas, please.", max_turns=3))
    assert result.final_output == "placed" and len(seen) == 1
    r = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=96,
        temperature=0,
        tool_choice="required",
        tools=[{"type": "function", "function": {"name": "place_order", "parameters": schema}}],
    )
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), schema)
    chain = CHAIN  # the probe's self-referring schema
    done = 0
    for seed in range(4):
        r = client.chat.completions.create(
            model="tiny",
            messages=ASK,
            max_tokens=80,
            temperature=1.0,
            seed=seed,
            tools=[{"type": "function", "function": {"name": "chain", "parameters": chain}}],
            tool_choice={"type": "function", "function": {"name": "chain"}},
        )
        if r.choices[0].finish_reason == "length":  # nested past the budget
            continue
        jsonschema.validate(
            json.loads(r.choices[0].message.tool_calls[0].function.arguments), chain
        )
        done += 1
    assert done


def test_grammars_are_bounded_and_a_deep_one_never_ends_the_server(server, client):
    """A Lark grammar over the size bound is a 400 naming it; a chain of
    3,000 rules (which overflows an ordinary thread's stack in the grammar
    compiler) is compiled on a large stack: served or refused by name, and
    the server goes on."""
    big = 'start: "a"\n' + "// pad\n" * 20_000
    status, body = post(
        server.port,
        "/v1/chat/completions",
        {"model": "tiny", "messages": ASK, "max_tokens": 2, "structured_outputs": {"grammar": big}},
    )
    assert status == 400 and "at most" in body["error"]["message"], body
    chain = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(3000)) + '\nr3000: "b"'
    status, body = post(
        server.port,
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": ASK,
            "max_tokens": 2,
            "structured_outputs": {"grammar": chain},
        },
    )
    assert status == 200 or (status == 400 and "structured_outputs" in body["error"]["message"])
    r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_thinking_goes_to_reasoning_content_streamed_or_not(client):
    from jaxkv.entrypoints.openai.reasoning import Reasoning

    kw = dict(
        model="tiny",
        messages=ASK,
        max_tokens=40,
        temperature=0,
        extra_body={
            "structured_outputs": {
                "regex": "<think>\nthe (cache|model) is (big|small)\n</think>\n\n(yes|no)"
            }
        },
    )
    m = client.chat.completions.create(**kw).choices[0].message
    thinking = m.model_extra["reasoning_content"]
    assert thinking.startswith("the ") and thinking.endswith("\n") and m.content in ("yes", "no")
    got = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for k in got:
            got[k] += (
                (
                    chunk.choices[0].delta.model_extra.get(k)
                    if k == "reasoning_content"
                    else chunk.choices[0].delta.content
                )
                or ""
                if chunk.choices
                else ""
            )
    assert got == {"reasoning_content": thinking, "content": m.content}
    # Without a <think> the answer is all content; DeepSeek-R1's way starts inside.
    assert Reasoning("qwen3", "").split("plain") == (None, "plain")
    assert Reasoning("deepseek_r1", "").split("hmm</think>ok") == ("hmm", "ok")
    assert Reasoning("qwen3", "<|im_start|>assistant\n<think>\n").split("a</think>b") == ("a", "b")
