"""Reasoning output (`--reasoning-parser`): a model that thinks in
`<think> ... </think>` before it answers (Qwen3, DeepSeek-R1) gets its
thinking in the message's `reasoning_content` (streamed as
`delta.reasoning_content`) and only the answer in `content`, which tool
calls are then read from.

"qwen3": thinking only where the answer opens `<think>` (or the rendered
prompt already did, as templates with thinking forced on end); an answer
without it is all content (Qwen3 with `enable_thinking: false`).
"deepseek_r1": the answer starts inside thinking unless it opens with
content; an unclosed `<think>` is all thinking, as those models are read.
`chat_template_kwargs` (`{"enable_thinking": false}`) reach the template."""

from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


class Reasoning:
    """One answer's split into (reasoning, content), whole or as it streams."""

    def __init__(self, parser: str, prompt: str):
        self.inside = parser == "deepseek_r1" or prompt.rstrip().endswith(OPEN)
        self.opened = self.inside  # thinking has begun (so a leading "<think>" is not content)
        self.buf = ""  # held back: may be the start of a tag
        self.skip_nl = self.inside

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) to send after `delta`."""
        text = self.buf + delta
        self.buf = ""
        reasoning, content = [], []
        while text:
            if self.skip_nl:  # the newlines after a tag belong to neither part
                text = text.lstrip("\n")
                if not text:
                    break
                self.skip_nl = False
            if not self.opened:  # before anything: an opening tag starts thinking
                stripped = text.lstrip()
                if OPEN.startswith(stripped) and not final:
                    self.buf = text
                    break
                self.opened = True
                if stripped.startswith(OPEN):
                    self.inside = True
                    self.skip_nl = True
                    text = stripped[len(OPEN) :]
                continue
            if not self.inside:
                content.append(text)
                break
            i = text.find(CLOSE)
            if i >= 0:
                reasoning.append(text[:i])
                text = text[i + len(CLOSE) :]
                self.inside = False
                self.skip_nl = True
                continue
            keep = 0 if final else _tail(text, CLOSE)
            reasoning.append(text[: len(text) - keep])
            self.buf = text[len(text) - keep :]
            break
        return "".join(reasoning), "".join(content)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a finished answer."""
        r, c = self.feed(text, True)
        return r or None, c


def _tail(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
