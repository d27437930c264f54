"""The grammar a forced tool call is held to (`tool_choice` "required" or a
named function): schema-valid calls in the parser's format, each
function's parameters the root of their own `$ref`s."""

from __future__ import annotations

import json


def grammar(tools) -> str:
    """The Lark grammar (llguidance's, with %json) of a forced answer to
    `tools` (a `tools.Tools`) in the parser's format (hermes blocks, or Llama 3's JSON joined by "; "): schema-
    valid calls, several for "required" with parallel calls, one for a name.
    Each function's parameters stay the root of their own references
    (`_rooted`): a Pydantic schema's `$defs` and a `"$ref": "#"` mean there
    what they mean in the tool's schema."""
    funcs = [f for f in tools.functions if tools.choice in ("required", f["name"])]
    key = "parameters" if tools.parser == "llama3_json" else "arguments"
    defs: dict = {}
    alts = [
        {
            "type": "object",
            "properties": {"name": {"const": f["name"]}, key: _rooted(f["parameters"], i, defs)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for i, f in enumerate(funcs)
    ]
    schema = dict(alts[0]) if len(alts) == 1 else {"anyOf": alts}
    if defs:
        schema["$defs"] = defs
    # JSON as json.dumps writes it: no free whitespace for a model to wander in.
    schema["x-guidance"] = {
        "whitespace_flexible": False,
        "item_separator": ", ",
        "key_separator": ": ",
    }
    several = tools.parallel and tools.choice == "required"
    if tools.parser == "llama3_json":
        repeat = ' ("; " body)*' if several else ""
        return f"start: body{repeat}\nbody: %json {json.dumps(schema)}"
    repeat = ' ("\\n" call)*' if several else ""
    return (
        f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n'
        f"body: %json {json.dumps(schema)}"
    )


def _rooted(params: dict, i: int, defs: dict) -> dict:
    """Function i's parameters as they sit inside the call's schema. Without
    references, as given. With them, the parameters (their own `$defs` /
    `definitions` taken out) become `defs["t{i}"]`, each of their
    definitions `defs["t{i}-NAME"]`, and every local reference is rewritten
    to point there: "#" to the parameters, "#/$defs/NAME..." to the
    definition, any other "#/..." into the parameters."""
    if '"$ref"' not in json.dumps(params):
        return params
    own = f"t{i}"

    def ref(r: str) -> str:
        if not r.startswith("#"):
            return r  # not local: left to the grammar compiler to refuse
        path = r[1:]
        for section in ("/$defs/", "/definitions/"):
            if path.startswith(section):
                return f"#/$defs/{own}-{path[len(section) :]}"
        return f"#/$defs/{own}{path}"

    def walk(x):
        if isinstance(x, dict):
            return {
                k: ref(v) if k == "$ref" and isinstance(v, str) else walk(v) for k, v in x.items()
            }
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    for section in ("$defs", "definitions"):
        for name, d in (params.get(section) or {}).items():
            defs[f"{own}-{name}"] = walk(d)
    defs[own] = walk({k: v for k, v in params.items() if k not in ("$defs", "definitions")})
    return {"$ref": f"#/$defs/{own}"}
