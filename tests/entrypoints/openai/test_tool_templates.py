"""Tool calling through a checkpoint's own chat template (one that renders
`tools`), with the real `openai` client: a Qwen-style template (hermes
blocks, `<think>` switched off by `enable_thinking`) and a Llama-3-style
one (JSON calls, `<|python_tag|>`), both written here, on a random 2-layer
model with SmolLM2's tokenizer. The prompt the server renders (POST
/tokenize with the chat request's fields) equals transformers'
`apply_chat_template` of the same conversation: the tools, an assistant's
calls with their arguments, a tool result, `chat_template_kwargs`. A
forced call comes back in the template's own format, parsed and valid
against its schema, streamed or not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest

from jaxkv.entrypoints.openai import tool_grammar
from jaxkv.entrypoints.openai import tools as T
from jaxkv.entrypoints.openai.tool_stream import StreamParser
from tests.helpers.serve_utils import ThreadServer, post

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast, né", "parameters": WEATHER},
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Lima", "days": 2}'},
}
CONVO = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Lima for two days?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear <&> calm"}'},
    {"role": "user", "content": "And in Paris for three?"},
]

# Qwen's layout, in this project's words: tools in the system turn, calls as
# <tool_call> blocks, results as <tool_response> user turns, and an empty
# think block when thinking is switched off.
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n"
    "{{ messages[0].content if messages[0].role == 'system' else 'You help.' }}\n\n"
    "Functions you may call:\n<tools>\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n</tools>\n"
    'Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages if m.role != 'system' %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    '{%- for c in m.tool_calls or [] %}\n<tool_call>\n{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n'
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)
# Llama 3's layout, likewise: results in ipython turns, calls as JSON.
LLAMA3_STYLE = (
    "{%- for m in messages %}<|im_start|>{{ 'ipython' if m.role == 'tool' else m.role }}\n"
    '{%- if m.tool_calls %}{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", '
    '"parameters": {{ c.function.arguments | tojson }}}{%- endfor %}'
    "{%- else %}{{ m.content }}{%- endif %}<|im_end|>\n{%- endfor %}"
    '{%- if tools %}<|im_start|>user\nAnswer with a call as JSON, {"name": ..., "parameters": ...}, '
    "after <|python_tag|> if you like. Functions:\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TEMPLATES = {"qwen": QWEN_STYLE, "llama3": LLAMA3_STYLE}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from jaxkv.core.engine import LLMEngine
    from jaxkv.entrypoints.openai.server import build_app
    from scripts.probe.common import make_tiny_model

    base = make_tiny_model(tmp_path_factory.mktemp("templates") / "model")
    out = {}
    for name, template in TEMPLATES.items():
        path = tmp_path_factory.mktemp(name) / "model"
        shutil.copytree(base, path)
        (path / "tokenizer" / "chat_template.jinja").write_text(template)
        eng = LLMEngine.from_pretrained(
            str(path), num_pages=64, page_size=16, max_num_seqs=2, warmup=False
        )
        out[name] = (ThreadServer(build_app(eng, ["tiny"])), path)
    yield out
    for srv, _ in out.values():
        srv.stop()


def _transformers(path: Path, template: str):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer" / "tokenizer.json"))
    tok.chat_template = template
    return tok


@pytest.mark.parametrize(
    "name, kwargs", [("qwen", {}), ("qwen", {"enable_thinking": False}), ("llama3", {})]
)
def test_the_rendered_prompt_is_transformers(servers, name, kwargs):
    srv, path = servers[name]
    hf = _transformers(path, TEMPLATES[name])
    theirs = [
        dict(
            m,
            tool_calls=[
                dict(
                    CALL,
                    function=dict(
                        CALL["function"], arguments=json.loads(CALL["function"]["arguments"])
                    ),
                )
            ],
        )
        if m.get("tool_calls")
        else m
        for m in CONVO
    ]
    text = hf.apply_chat_template(
        theirs, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs
    )
    if name == "qwen":
        assert "<tools>" in text and ("<think>" in text) == ("enable_thinking" in kwargs)
    code, body = post(
        srv.port,
        "/tokenize",
        {"model": "tiny", "messages": CONVO, "tools": TOOLS, "chat_template_kwargs": kwargs},
    )
    assert code == 200, body
    assert body["tokens"] == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["qwen", "llama3"])
def test_a_forced_call_comes_back_parsed_in_the_templates_format(servers, name):
    srv, _ = servers[name]
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
    kw = dict(
        model="tiny",
        messages=CONVO,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    parts: dict = {}
    pieces = 0
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            p = parts.setdefault(d.index, {"name": "", "arguments": ""})
            p["name"] += d.function.name or ""
            p["arguments"] += d.function.arguments or ""
            pieces += bool(d.function.arguments)
    assert parts == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    # hermes: a forced call's arguments stream as the model writes them
    assert pieces > 1 if name == "qwen" else pieces == 1


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_forced_calls_arguments_stream_piece_by_piece(step):
    tools = T.check_tools(
        {
            "tools": TOOLS + [{"type": "function", "function": {"name": "noop"}}],
            "tool_choice": "required",
        },
        "hermes",
    )
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x}\\"y", "days": [1, {}]}}'
        '\n</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    )
    parser, args, heads = StreamParser(tools), {}, []
    pieces = [text[i : i + step] for i in range(0, len(text), step)] + [""]
    for j, piece in enumerate(pieces):
        content, deltas = parser.feed(piece, j == len(pieces) - 1)
        assert content == ""  # the gaps between calls are no content
        for d in deltas:
            heads += [d["function"]["name"]] if "id" in d else []
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    assert heads == ["get_weather", "noop"]
    assert list(args.values()) == [c["function"]["arguments"] for c in T.parse(text, tools)[1]]


def test_llama3_calls_parse_whole_and_content_streams_at_once():
    tools = T.check_tools(
        {"tools": TOOLS + [{"type": "function", "function": {"name": "noop"}}]}, "llama3_json"
    )
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b", "days": 1}}; '
        '{"name": "noop", "parameters": {}}'
    )
    content, calls = T.parse(text, tools)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "a;b", "days": 1}
    for half in ('{"name": "get_weather", "parameters": {}} and more', '{"name": "other"}'):
        assert T.parse(half, tools) == (half, [])  # not all calls: all content
    grammar = tool_grammar.grammar(T.Tools(tools.functions, "required", True, "llama3_json"))
    assert '"parameters"' in grammar and "<tool_call>" not in grammar
    stream = StreamParser(tools)
    assert stream.feed(" <|pyth", False) == ("", [])  # may still be the tag
    stream = StreamParser(tools)
    assert stream.feed(" Sure", False) == (" Sure", []) and stream.feed(", no.", True) == (
        ", no.",
        [],
    )
