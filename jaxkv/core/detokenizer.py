"""Incremental detokenizing: each new token's text in O(1), however long
the output.

`tokenizers`' own `DecodeStream` decodes a small window of the newest
tokens against the text it already gave, so the pieces joined are the
text `decode(all ids)` gives; it holds a token back while it ends in an
incomplete UTF-8 character. `flush` gives what is held back at the end
(the replacement characters a whole decode gives there).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """One output's stream: `step(token) -> new text` ("" while held back)."""

    __slots__ = ("_stream", "_tok", "_skip", "_held")

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer.tokenizer  # the tokenizers.Tokenizer under jaxkv's Tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []

    def step(self, token: int) -> str:
        piece = self._stream.step(self._tok, token)
        if piece is None:
            self._held.append(token)
            return ""
        if self._held:
            self._held.clear()
        return piece

    def flush(self) -> str:
        """The text of tokens still held back (an incomplete character at
        the end of the output)."""
        if not self._held:
            return ""
        text = self._tok.decode(self._held, skip_special_tokens=self._skip)
        self._held = []
        return text
