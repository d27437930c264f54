"""The field readers of `checkpoints.hf_config` (and `checkpoints.moe_config`,
`checkpoints.gguf_config`): a config value as a number or a boolean, its
default only when absent, ValueError naming the field when present but
invalid."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

_REQUIRED = object()


def _num(
    cfg: Mapping[str, Any],
    key: str,
    kind,
    default=_REQUIRED,
    *,
    name: str | None = None,
    positive: bool = False,
):
    """cfg[key] as `kind` (int or float), `default` when it is absent or
    null; ValueError naming the key (or `name`) when required and missing,
    not a number, or (`positive`) not a positive finite number. Only an
    absent value gets the default: a present but invalid one is an error."""
    name = name or key
    v = cfg.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ValueError(f"{name}: missing from config")
        return default
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or (kind is int and isinstance(v, float) and not v.is_integer())
    ):
        raise ValueError(
            f"{name}: must be {'an integer' if kind is int else 'a number'}, got {str(v)[:80]}"
        )
    if positive and not 0 < v < math.inf:  # NaN fails the comparison too
        raise ValueError(
            f"{name}: must be a positive {'integer' if kind is int else 'finite number'}, got {v!r}"
        )
    return kind(v)


def _bool(
    cfg: Mapping[str, Any], key: str, default: bool = False, *, name: str | None = None
) -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{name or key}: must be true or false, got {str(v)[:80]}")
    return v
