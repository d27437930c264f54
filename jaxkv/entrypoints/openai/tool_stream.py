"""Tool calls out of a streamed answer, as OpenAI streams them: content
deltas, and for each call its id and name first, then its arguments.

Text that may start a call is held back until it is one or cannot be (then
it is content). A forced call (`tool_choice` "required" or a named
function, held to the grammar of `tool_grammar.grammar`) streams its arguments as
the model writes them: the header goes out once `{"name": ..., "arguments":`
is read, then each piece of the arguments' JSON up to the object's close;
the grammar makes sure the call it began parses. An "auto" call goes out
whole when its block closes, for what the model wrote there may not parse
(then it is content). Llama 3's answers are all calls (read at the end) or
all content (streamed once it cannot begin a call)."""

from __future__ import annotations

import re

from jaxkv.entrypoints.openai.tools import PYTHON_TAG, Tools, new_call, parse

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = re.compile(r'<tool_call>\s*\{"name": "([^"\\]+)", "arguments": ')


class StreamParser:
    def __init__(self, tools: Tools):
        self.tools = tools  # text: everything so far
        self.text = ""
        self.calls = 0
        self.sent = 0  # characters of text decided (sent as content or parsed into calls)
        self.open: _Arguments | None = None  # a forced call whose arguments are streaming
        self.content_only = False  # Llama 3: the answer cannot begin a call

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        """(content to send, tool-call deltas to send) after `delta`."""
        self.text += delta
        if self.tools.parser != "hermes":
            if not self.content_only:
                head = self.text.lstrip()
                self.content_only = bool(head) and not (
                    head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head)
                )
            if self.content_only:
                content, self.sent = self.text[self.sent :], len(self.text)
                return content, []
            if not final:
                return "", []
            content, calls = parse(self.text[self.sent :], self.tools)
            self.sent = len(self.text)
            return content or "", self._deltas(calls)
        content, out = "", []
        while True:
            pending = self.text[self.sent :]
            start = pending.find(OPEN)
            if start < 0:  # hold back a tail that may begin "<tool_call>"
                keep = 0 if final else _partial_tail(pending, OPEN)
                piece = pending[: len(pending) - keep]
                if not piece.strip() and not final:
                    break  # whitespace waits: before a call it is no content
                content += piece if piece.strip() or not self.calls else ""
                self.sent += len(piece)
                break
            end = pending.find(CLOSE, start)
            gap = not pending[:start].strip()  # whitespace before a call is no content
            if end < 0 and not final:
                if not gap:
                    content += pending[:start]
                    self.sent, start = self.sent + start, 0
                if self.tools.forced:
                    out += self._stream_open(self.sent + start)
                break
            stop = len(pending) if end < 0 else end + len(CLOSE)
            if self.open is not None:  # its header went out: the rest of its arguments
                out += self._stream_open(self.sent + start)
                self.open = None
                self.sent += stop
                continue
            c, found = parse(pending[start:stop], self.tools) if end >= 0 else (None, [])
            if found and (self.tools.parallel or self.calls == 0):
                content += "" if gap else pending[:start]
                out += self._deltas(found)
            else:
                content += pending[:stop]
            self.sent += stop
        return content, out

    def _stream_open(self, at: int) -> list[dict]:
        """Deltas of the forced call whose block begins at `at`."""
        out = []
        if self.open is None:
            m = HEAD.match(self.text, at)
            if m is None or m.group(1) not in self.tools.names():
                return []
            self.open = _Arguments(self.calls, m.end())
            self.calls += 1
            out.append(
                {
                    "index": self.open.index,
                    "id": new_call(m.group(1), "")["id"],
                    "type": "function",
                    "function": {"name": m.group(1), "arguments": ""},
                }
            )
        a = self.open
        stop = a.read(self.text)
        if stop > a.sent:
            out.append({"index": a.index, "function": {"arguments": self.text[a.sent : stop]}})
            a.sent = stop
        return out

    def _deltas(self, calls: list[dict]) -> list[dict]:
        out = []
        for c in calls:
            i = self.calls
            self.calls += 1
            out.append(
                {
                    "index": i,
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": ""},
                }
            )
            out.append({"index": i, "function": {"arguments": c["function"]["arguments"]}})
        return out


class _Arguments:
    """A streaming call's arguments: the JSON object from `begin` in the
    answer, each character read once, up to where it closes."""

    def __init__(self, index: int, begin: int):
        self.index = index  # sent: end of what went out
        self.sent = begin
        self.pos = begin
        self.depth = 0
        self.string = False
        self.escape = False
        self.end = None

    def read(self, text: str) -> int:
        """How far the arguments reach in `text` (their close, once read)."""
        while self.end is None and self.pos < len(text):
            ch = text[self.pos]
            self.pos += 1
            if self.string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.string = False
            elif ch == '"':
                self.string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos
        return self.pos


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
