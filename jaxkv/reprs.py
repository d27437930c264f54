"""Short reprs for error messages: a request or file may hold megabytes in
the field an error names, and neither the message nor the work of writing
it may grow with that (`short`: at most about `n` characters, whatever the
value; `clip`: a message cut to a bound)."""

from __future__ import annotations

import reprlib

_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 120
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 8
_REPR.maxlevel = 3


def short(value, n: int = 120) -> str:
    """repr(value), written lazily and cut to about `n` characters."""
    return clip(_REPR.repr(value), n)


def clip(text: str, n: int = 600) -> str:
    """`text` cut to `n` characters, saying how many were left out."""
    if len(text) <= n:
        return text
    return f"{text[:n]}... ({len(text) - n} more characters)"
