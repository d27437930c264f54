"""Tool calling on /v1/chat/completions: the request's `tools`,
`tool_choice` and `parallel_tool_calls` checked field by field, the
conversation's tool calls and results made ready for the chat template, the
grammar that forces a call, and the parser that reads calls out of a
finished answer (`tool_stream` reads them out of a streamed one).

Formats (`--tool-call-parser`, else by the model's family):

- "hermes": `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call, as Qwen2.5 / Qwen3 write them. Also the format of the
  fallback below, so the default model's calls are read with it.
- "llama3_json": Llama 3's `{"name": ..., "parameters": {...}}` (after an
  optional `<|python_tag|>`), several joined by `;`; an answer is all calls
  or all content, and content streams as soon as it cannot begin a call.

Where the checkpoint's chat template renders tools itself (it names
`tools`), it gets them (`tools=[...]`, assistant `tool_calls` with parsed
arguments, `role: "tool"` results). Where it does not (SmolLM2's), the
fallback: a system message lists the functions as JSON schemas and asks for
hermes blocks, earlier calls are written back as hermes blocks, and results
come as user turns in `<tool_response>` tags.

`tool_choice` "required" or a named function constrains the answer with a
grammar (llguidance's, `tool_grammar`) in the parser's format, built from
the functions' JSON schemas, so the arguments always parse and validate; "auto" parses
what the model wrote, and text that does not parse stays content."""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from jaxkv.entrypoints.openai.protocol import APIError
from jaxkv.reprs import clip, short

PARSERS = ("hermes", "llama3_json")
MAX_TOOLS = 128  # OpenAI's bound
MAX_TOOLS_CHARS = 96 * 1024  # every function's description and parameters, as JSON
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
PYTHON_TAG = "<|python_tag|>"
NO_PARAMETERS = {"type": "object", "properties": {}}
FALLBACK_PROMPT = (
    'You can call these functions. To call one, answer with <tool_call>{{"name": the '
    'function\'s name, "arguments": an object of its arguments}}</tool_call> (one block per '
    "call) and nothing else.\nFunctions:\n{functions}"
)


@dataclasses.dataclass
class Tools:
    functions: list[dict]  # {"name", "description", "parameters"}
    choice: str  # "auto", "required" or a function's name
    parallel: bool
    parser: str

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]


def check_tools(body: dict, parser: str) -> Tools | None:
    """The request's tools (None: no tools, or tool_choice "none")."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError("parallel_tool_calls: must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise APIError("tool_choice: needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise APIError("tools: must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(f"tools: {len(tools)} tools; at most {MAX_TOOLS}", "tools")
    functions = [_function(t, i) for i, t in enumerate(tools)]
    size = sum(len(json.dumps([f["description"], f["parameters"]])) for f in functions)
    if size > MAX_TOOLS_CHARS:
        raise APIError(
            f"tools: {size} characters of descriptions and parameter schemas; at "
            f"most {MAX_TOOLS_CHARS}",
            "tools",
        )
    names = [f["name"] for f in functions]
    for i, n in enumerate(names):
        if n in names[:i]:
            raise APIError(
                f"tools[{i}].function.name: {short(n)} is given twice", f"tools[{i}].function.name"
            )
    if choice is None or choice == "auto":
        choice = "auto"
    elif choice == "none":
        return None
    elif choice != "required":
        ok = (
            isinstance(choice, dict)
            and choice.get("type") == "function"
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)
        )
        if not ok:
            raise APIError(
                "tool_choice: must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}",
                "tool_choice",
            )
        choice = choice["function"]["name"]
        if choice not in names:
            raise APIError(
                f"tool_choice: no tool is named {short(choice)} (tools: {', '.join(names)})",
                "tool_choice",
            )
    return Tools(functions, choice, parallel, parser)


def _function(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(
            f"{where}: only {{'type': 'function', 'function': {{...}}}} tools are supported",
            f"{where}.type",
        )
    f = tool.get("function")
    if not isinstance(f, dict):
        raise APIError(f"{where}.function: must be an object", f"{where}.function")
    name = f.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise APIError(
            f"{where}.function.name: must be 1-64 letters, digits, '_', '.' or '-', "
            f"got {short(name)}",
            f"{where}.function.name",
        )
    desc = f.get("description")
    if desc is not None and not isinstance(desc, str):
        raise APIError(
            f"{where}.function.description: must be a string", f"{where}.function.description"
        )
    params = f.get("parameters", NO_PARAMETERS)
    if params is None:
        params = NO_PARAMETERS
    problem = _schema_problem(params)
    if problem:
        raise APIError(f"{where}.function.parameters: {problem}", f"{where}.function.parameters")
    return {"name": name, "description": desc, "parameters": params}


def _schema_problem(schema) -> str | None:
    """Why `schema` is no JSON schema of an object the grammar engine can
    follow (None: it is)."""
    if not isinstance(schema, dict):
        return "must be a JSON schema object"
    if schema.get("type", "object") != "object":
        return f"must describe an object (type 'object'), got type {short(schema.get('type'))}"
    size = len(json.dumps(schema))
    if size > MAX_TOOLS_CHARS:
        return f"{size} characters; at most {MAX_TOOLS_CHARS}"
    from llguidance import LLMatcher

    from jaxkv.core.structured import COMPILE_SECONDS, on_large_stack

    try:
        err = on_large_stack(
            lambda: LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema)),
            COMPILE_SECONDS,
        )
    except Exception as e:  # llguidance's own message names the schema's fault
        err = str(e)
    return f"not a usable JSON schema ({clip(err, 300)})" if err else None


def template_renders_tools(chat_template: str) -> bool:
    return "tools" in chat_template


def for_template(
    messages: list[dict], tools: Tools | None, native: bool
) -> tuple[list[dict], dict]:
    """(messages, extra template arguments) for the chat template: native
    (the template renders tools) or the fallback of the module docstring."""
    if native:
        extra = (
            {
                "tools": [
                    {"type": "function", "function": {k: v for k, v in f.items() if v is not None}}
                    for f in tools.functions
                ]
            }
            if tools
            else {}
        )
        return messages, extra
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = "\n".join(
                hermes_block(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            )
            out.append(
                {
                    "role": "assistant",
                    "content": (m["content"] + "\n" if m["content"] else "") + blocks,
                }
            )
        elif m["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        listing = "\n".join(
            json.dumps({k: v for k, v in f.items() if v is not None}) for f in tools.functions
        )
        preamble = FALLBACK_PROMPT.format(functions=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, {}


def hermes_block(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def new_call(name: str, arguments) -> dict:
    """An OpenAI tool call; `arguments` as JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def parse(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished answer: calls to the request's
    functions that parse; everything else stays content (None if empty)."""
    names = set(tools.names())
    calls, rest = [], text
    if tools.parser == "hermes":
        kept = []
        pos = 0
        for m in HERMES.finditer(text):
            call = _call(m.group(1), names, "arguments")
            if call is None:
                continue
            kept.append(text[pos : m.start()])
            pos = m.end()
            calls.append(call)
        rest = "".join(kept) + text[pos:]
    else:  # llama3_json: the whole answer is calls, or none is
        parsed = _json_calls(text.strip().removeprefix(PYTHON_TAG).strip(), names)
        if parsed:
            calls, rest = parsed, ""
    if calls and not tools.parallel:
        calls = calls[:1]
    rest = rest.strip()
    return (rest or None), calls


def _json_calls(body: str, names: set) -> list[dict]:
    """Llama 3's calls: JSON objects separated by ";" (a ";" inside a string
    is the string's); [] unless the whole of `body` is calls."""
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return []
        call = _call(obj, names, "parameters")
        if call is None:
            return []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in "; \t\n":
            pos += 1
    return calls


def _call(text, names: set, key: str) -> dict | None:
    try:
        obj = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(key, obj.get("arguments", {}))
    if not isinstance(args, dict):
        return None
    return new_call(obj["name"], args)
