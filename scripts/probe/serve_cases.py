"""The case table of the HTTP probe (scripts/probe/serve.py): the request constants it shares with
the runner (API key, request-size limit, endpoints, the greedy and bystander bodies) and
`plan_probes(vocab)`, which lists the ~130 hostile or careless requests and the controls among
them, each with the words its error must name and what answer is expected."""

from __future__ import annotations

import json
import random

KEY = "probe-key"
MAX_BYTES = 1 << 20
C, CH = "/v1/completions", "/v1/chat/completions"
GREEDY = {"temperature": 0, "max_tokens": 8}
BYSTANDER = {
    "messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}],
    "temperature": 0,
    "max_tokens": 64,
    "ignore_eos": True,
}


def plan_probes(vocab: int) -> list[tuple]:
    """(case, method, path, body | None, extra call kwargs, words named, expect)."""
    P = {"prompt": "Hello there", "max_tokens": 4}
    M = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    out: list[tuple] = []

    def err(case, path, body, *words, method="POST", **kw):
        out.append((case, method, path, body, kw, words or (case.split(":")[0],), "err"))

    def ok(case, path, body, expect="ok", *words, **kw):
        out.append(
            (case, "POST", path, {**GREEDY, **body} if path in (C, CH) else body, kw, words, expect)
        )

    auth = ("authorization", "api key")
    for path, method in (
        (C, "POST"),
        (CH, "POST"),
        ("/v1/models", "GET"),
        ("/metrics", "GET"),
        ("/tokenize", "POST"),
        ("/detokenize", "POST"),
    ):
        err(f"no key {path}", path, P if method == "POST" else None, *auth, method=method, key=None)
    err(f"wrong key {C}", C, P, *auth, key="nope")
    err(f"basic auth {CH}", CH, M, *auth, key=None, headers={"Authorization": f"Basic {KEY}"})
    shapes = {
        "bad json": b'{"prompt": "hi",',
        "array": b"[1, 2]",
        "string": b'"hi"',
        "null": b"null",
        "empty": b"",
        "bad utf8": b'{"prompt": "\xff\xfe"}',
    }
    for path in (C, CH, "/tokenize", "/detokenize"):
        for name, raw in list(shapes.items())[: {C: 6, CH: 4}.get(path, 2)]:
            err(f"{name} {path}", path, None, "request body", "json", "object", raw=raw)
    err(f"NaN {C}", C, None, "temperature", raw=b'{"prompt": "hi", "temperature": NaN}')
    err(f"Infinity {CH}", CH, None, "top_p", raw=json.dumps({**M, "top_p": float("inf")}).encode())
    err("prompt: missing", C, {"max_tokens": 4})
    err("messages: missing", CH, {"max_tokens": 4})
    err("prompt: empty", C, {**P, "prompt": ""})
    bad = {
        "max_tokens": [-1, "abc", 1e30],
        "temperature": ["NaN", "abc", -1],
        "top_p": [2, -0.5],
        "top_k": [-5],
        "min_p": [2],
        "presence_penalty": [1e9],
        "frequency_penalty": ["x"],
        "repetition_penalty": [0],
        "n": [0, 1000],
        "stop": [{"a": 1}, [1, 2]],
        "stop_token_ids": [[-1]],
        "logit_bias": [{"²": 1}, {"1": 1e30}, {str(vocab + 5): 1}],
        "seed": ["x"],
        "logprobs": [1000],
        "ignore_eos": ["yes"],
        "min_tokens": [100],
        "allowed_token_ids": [[]],
        "bad_words": [[""]],
        "prompt_logprobs": [1000],
        "stream": ["yes"],
        "echo": ["yes"],
        "best_of": [3],
        "suffix": ["x"],
    }
    for field, values in bad.items():
        for v in values:
            err(f"{field}: {v!r}"[:60], C, {**P, field: v}, field)
    err(
        "stream_options without stream",
        C,
        {**P, "stream_options": {"include_usage": True}},
        "stream_options",
    )
    err(
        "max_completion_tokens: 'x'",
        CH,
        {**M, "max_completion_tokens": "x"},
        "max_completion_tokens",
    )
    err("logprobs: 'yes' chat", CH, {**M, "logprobs": "yes"}, "logprobs")
    err(
        "top_logprobs: 1000",
        CH,
        {**M, "logprobs": True, "top_logprobs": 1000},
        "top_logprobs",
        "logprobs",
    )
    err("top_logprobs without logprobs", CH, {**M, "top_logprobs": 2}, "top_logprobs")
    err(
        "tools: bad schema",
        CH,
        {
            **M,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": 5}}},
                    },
                }
            ],
        },
        "tools[0].function.parameters",
    )
    err("tool_choice: required, no tools", CH, {**M, "tool_choice": "required"}, "tool_choice")
    err("model: unknown", C, {**P, "model": "gpt-5"}, "model")
    err(
        "prompt: nested 200 deep",
        C,
        {**P, "prompt": json.loads("[" * 200 + "1" + "]" * 200)},
        "prompt",
    )
    err("prompt: 1000 prompts", C, {**P, "prompt": ["hi"] * 1000}, "prompt")
    err("prompt: mixed ids", C, {**P, "prompt": [[1, 2], [3, "a"]]}, "prompt")
    err("prompt: negative id", C, {**P, "prompt": [-1, 5]}, "prompt", "token")
    err("prompt: id beyond vocab", C, {**P, "prompt": [10**9]}, "prompt", "token")
    err(
        "prompt: longer than max len", C, {**P, "prompt": "hello " * 5000}, "prompt", "model length"
    )
    err("prompt: 3000 ids", C, {**P, "prompt": [5] * 3000}, "prompt", "model length")
    err("max_tokens: beyond max len", C, {**P, "max_tokens": 100000}, "max_tokens", "model length")
    err("json nested 5000 deep", C, None, "nested", "json", raw=b"[" * 5000 + b"]" * 5000)
    err(
        "prompt nested 5000 deep",
        C,
        None,
        "nested",
        "json",
        raw=b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    )
    big = json.dumps({**P, "prompt": "x" * (MAX_BYTES + 10)}).encode()
    err("413 content-length", C, None, "bytes", "max-request-bytes", raw=big)
    err("413 chunked", C, None, "bytes", "max-request-bytes", raw=big, chunked=True)
    err(
        "413 huge content-length",
        C,
        None,
        "bytes",
        raw=b"{}",
        headers={"Content-Length": str(10**12)},
    )
    err(
        "form body",
        C,
        None,
        "json",
        "request body",
        raw=b"prompt=hi",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    err(
        "prompt: lone surrogate",
        C,
        None,
        "surrogate",
        "unicode",
        "prompt",
        raw=b'{"prompt": "a\\ud800b"}',
    )
    err(
        "messages: lone surrogate",
        CH,
        None,
        "surrogate",
        "unicode",
        "messages",
        raw=b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    )
    err(
        "stop: lone surrogate",
        C,
        None,
        "surrogate",
        "unicode",
        "stop",
        raw=b'{"prompt": "hi", "stop": "\\ud800"}',
    )
    err(
        "tokenize: lone surrogate",
        "/tokenize",
        None,
        "surrogate",
        "unicode",
        "prompt",
        raw=b'{"prompt": "\\ud800"}',
    )
    err("messages: empty", CH, {**M, "messages": []}, "messages")
    err(
        "messages: role number",
        CH,
        {**M, "messages": [{"role": 5, "content": "hi"}]},
        "role",
        "messages",
    )
    err("messages: not objects", CH, {**M, "messages": ["hi"]}, "messages")
    err(
        "messages: content number",
        CH,
        {**M, "messages": [{"role": "user", "content": 5}]},
        "content",
        "messages",
    )
    err(
        "messages: image part",
        CH,
        {
            **M,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ],
        },
        "content",
        "text parts",
    )
    err(
        "messages: unknown part",
        CH,
        {**M, "messages": [{"role": "user", "content": [{"type": "blob"}]}]},
        "content",
    )
    err(
        "chat_template_kwargs: list", CH, {**M, "chat_template_kwargs": [1]}, "chat_template_kwargs"
    )
    so_words = ("response_format", "schema", "json", "structured", "regex", "choice", "grammar")
    err(
        "response_format: bad schema",
        CH,
        {
            **M,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
            },
        },
        *so_words,
    )
    err("response_format: type xml", CH, {**M, "response_format": {"type": "xml"}}, *so_words)
    err(
        "response_format: schema list",
        CH,
        {
            **M,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        },
        *so_words,
    )
    err("guided_regex: (((", C, {**P, "guided_regex": "((("}, *so_words)
    err("guided_choice: []", C, {**P, "guided_choice": []}, *so_words)
    err("structured_outputs: string", C, {**P, "structured_outputs": "x"}, *so_words)
    err("two structured fields", C, {**P, "guided_regex": "a+", "guided_choice": ["a"]}, *so_words)
    ok(
        "guided_choice: 40000 choices",
        C,
        {**P, "guided_choice": [f"c{i:06d}" for i in range(40000)]},
        "either",
        "choice",
    )
    for path in ("/v1/nope", "/%2e%2e/etc/passwd"):
        err(f"404 {path}", path, P, "not found")
    for method, path in (("GET", C), ("PUT", CH), ("POST", "/health")):
        err(f"405 {method} {path}", path, P if method != "GET" else None, "method", method=method)
    for v in ([-1], [vocab], [10**30], ["a"], "abc"):
        err(f"detokenize: {v!r}", "/detokenize", {"tokens": v}, "tokens")
    err("tokenize: prompt number", "/tokenize", {"prompt": 5}, "prompt")
    err(
        "tokenize: add_special_tokens",
        "/tokenize",
        {"prompt": "hi", "add_special_tokens": "x"},
        "add_special_tokens",
    )
    ok("tokenize: ok", "/tokenize", {"prompt": "Hello there"})
    ok("detokenize: ok", "/detokenize", {"tokens": [1, 2, 3, 100]})
    for n in (2, 3, 5, 7):
        ok(f"n={n}", C, {**P, "n": n})
    ok("chat", CH, M)
    ok(
        "text/plain content type",
        C,
        P,
        "either",
        "content-type",
        headers={"Content-Type": "text/plain"},
    )
    ok("no content type", C, P, "either", "content-type", headers={"Content-Type": ""})
    ok("unicode emoji rtl nul", C, {**P, "prompt": "héllo 👩‍👩‍👧 שלום \u200b\u0000 end"})
    ok("seed 2**70 sampled", C, {**P, "temperature": 1.0, "seed": 2**70}, "either", "seed")
    ok("prompt ids", C, {**P, "prompt": [1, 2, 3]})
    ok(
        "role wizard",
        CH,
        {**M, "messages": [{"role": "wizard", "content": "hi"}]},
        "either",
        "role",
        "messages",
    )
    ok("unknown fields", C, {**P, **{f"junk{i}": i for i in range(2000)}})
    out.append(("stream control", "STREAM", C, {**GREEDY, **P}, {}, (), "ok"))
    for i in range(2):
        out.append(
            (
                f"disconnect mid-stream {i}",
                "CUT",
                CH if i % 2 else C,
                {**BYSTANDER, "max_tokens": 400, "prompt": "Once"},
                {},
                (),
                "ok",
            )
        )
    out.append(("disconnect mid-body", "HALF", C, P, {}, (), "ok"))
    random.Random(0).shuffle(out)  # controls among the hostile ones
    return out
