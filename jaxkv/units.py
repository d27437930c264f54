"""Byte sizes with units, as options and keywords take them: '24GB',
'512MiB', '64 MB', '1e9'."""

from __future__ import annotations

_UNITS = {
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "B": 1,
}


def parse_size(text: str) -> int:
    """'24GB', '512MiB', '64 MB', '1e9' -> bytes (ValueError if not a size)."""
    t = str(text).strip().upper().replace(" ", "")
    try:
        for u, m in _UNITS.items():
            if t.endswith(u):
                return int(float(t[: -len(u)]) * m)
        return int(float(t))
    except ValueError:
        raise ValueError(f"not a size in bytes: {text!r} (e.g. 24GB, 512MiB)") from None
