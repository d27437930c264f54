"""The HTTP probe's cases of the third reliability round (scripts/probe/serve.py): hostile LoRA
adapter folders given to /v1/load_lora_adapter, a folder outside --lora-root, bounded Responses
fields, tool schemas with `$ref`, oversized and deeply chained grammars, a foreign Host header, and
the connection-level cases (silent sockets, a slow head, a slow body) that `send` runs as methods
SILENT, SLOWHEAD and SLOWBODY. Same tuple shape as probe_http_cases.plan_probes."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from scripts.probe.adapters import good_adapter, hostile_adapters
from scripts.probe.serve_cases import CH, GREEDY, KEY

TIMEOUT = 30.0

LOAD, R = "/v1/load_lora_adapter", "/v1/responses"
ORDER = {
    "type": "object",
    "$defs": {
        "Item": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "qty": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["name", "qty"],
            "additionalProperties": False,
        }
    },
    "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "maxItems": 2}},
    "required": ["items"],
    "additionalProperties": False,
}
CHAIN = {
    "type": "object",
    "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["v", "next"],
    "additionalProperties": False,
}


def plan_hostile(loras: Path, config) -> list[tuple]:
    """(case, method, path, body | None, extra call kwargs, words named, expect)."""
    out: list[tuple] = []
    M = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def err(case, path, body, *words, method="POST", **kw):
        out.append((case, method, path, body, kw, words, "err"))

    for case, (folder, words) in hostile_adapters(loras / "hostile", config).items():
        err(f"adapter: {case}", LOAD, {"lora_name": case, "lora_path": str(folder)}, words)
    outside = good_adapter(loras.parent / "outside", config, "x")
    err(
        "adapter: outside --lora-root",
        LOAD,
        {"lora_name": "o", "lora_path": str(outside)},
        "--lora-root",
    )
    base = {"input": "hi", "max_output_tokens": 4}
    err(
        "responses: 17 metadata pairs",
        R,
        {**base, "metadata": {f"k{i}": "v" for i in range(17)}},
        "metadata",
    )
    err(
        "responses: metadata value 600 KB",
        R,
        {**base, "metadata": {"k": "v" * 600_000}},
        "metadata",
    )
    err("responses: metadata not strings", R, {**base, "metadata": {"k": [1] * 10_000}}, "metadata")
    err(
        "responses: text.format junk",
        R,
        {**base, "text": {"format": {"type": "text", "x": 1}}},
        "text.format",
    )
    err(
        "responses: previous id a list",
        R,
        {**base, "previous_response_id": [7] * 100_000},
        "previous_response_id",
    )
    err(
        "responses: GET 300-char id",
        "/v1/responses/" + "r" * 300,
        None,
        "response_id",
        method="GET",
    )
    err(
        "tools: 200 tools",
        CH,
        {**M, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]},
        "tools",
    )
    err(
        "grammar: 200 KB",
        CH,
        {**M, "structured_outputs": {"grammar": 'start: "a"\n' + "#" * 200_000}},
        "structured_outputs",
        "grammar",
    )
    chain = "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(3000)) + '\nr3000: "b"'
    out.append(
        (
            "grammar: 3000-rule chain",
            "POST",
            CH,
            {**GREEDY, **M, "structured_outputs": {"grammar": chain}},
            {},
            ("structured_outputs", "grammar"),
            "either",
        )
    )
    err("Host: evil.example", CH, M, "host", headers={"Host": "evil.example"})
    for name, schema in (("$defs", ORDER), ("$ref #", CHAIN)):
        out.append(
            (
                f"tools: forced, {name}",
                "POST",
                CH,
                {
                    **GREEDY,
                    **M,
                    "max_tokens": 96,
                    "tools": [
                        {"type": "function", "function": {"name": "f", "parameters": schema}}
                    ],
                    "tool_choice": "required",
                },
                {},
                (),
                "ok",
            )
        )
    out.append(("1000 silent sockets", "SILENT", "/health", None, {}, (), "ok"))
    out.append(("slow request head", "SLOWHEAD", "/health", None, {}, ("408",), "err"))
    out.append(("slow request body", "SLOWBODY", "/tokenize", None, {}, ("408",), "err"))
    return out


def invalid_calls(body: dict, resp) -> str | None:
    """Why a forced call's arguments break its tool's own schema (None: every call validates, or
    the answer ran out of tokens before its call was complete)."""
    import jsonschema

    if any(ch.get("finish_reason") == "length" for ch in resp.get("choices", [])):
        return None
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in body["tools"]}
    calls = [
        c
        for ch in resp.get("choices", [])
        for c in (ch.get("message") or {}).get("tool_calls") or []
    ]
    for c in calls:
        try:
            jsonschema.validate(
                json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]]
            )
        except (ValueError, KeyError, jsonschema.ValidationError) as e:
            return f"{type(e).__name__}: {str(e)[:200]}"
    return None if calls else "no tool call"


def sockets(port: int, method: str) -> tuple[str, str]:
    """SILENT: 1000 idle connections, /health within 1 s. SLOWHEAD / SLOWBODY: a request head or
    body that never completes gets 408 once the server's deadline passes."""
    if method == "SILENT":
        held = [socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) for _ in range(1000)]
        try:
            t0 = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                answer = s.recv(64)
            took = time.monotonic() - t0
            ok = answer.startswith(b"HTTP/1.1 200") and took < 1.0
            return ("served" if ok else "hangs"), f"/health {answer[:12]!r} in {took:.2f}s"
        finally:
            for s in held:
                s.close()
    data = (
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if method == "SLOWHEAD"
        else f"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Length: 100\r\n\r\n{".encode()
    )
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        s.sendall(data)
        t0 = time.monotonic()
        first = s.recv(4096)
    took = time.monotonic() - t0
    if first.startswith(b"HTTP/1.1 408"):
        return "named", f"408 after {took:.1f}s"
    return ("hangs" if not first else "unnamed"), f"after {took:.1f}s: {first[:200]!r}"
