"""Command-line options derived from config dataclasses, so a new engine or
sampling field is a new option with no second edit: the option is the
field name with dashes (`max_num_seqs` -> ``--max-num-seqs``), its help and
choices come from the field's metadata, its type and default from the
field. Booleans get ``--x`` / ``--no-x``; list fields are repeatable."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from collections.abc import Mapping
from typing import Any

from jaxkv.units import parse_size as units_parse_size


def parse_size(text: str) -> int:
    """'24GB', '512MiB', '1e9' -> bytes (`jaxkv.units.parse_size`, as an
    argparse type)."""
    try:
        return units_parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r} ({e})") from None


def _base_type(hint) -> tuple[type, bool]:
    """(scalar type, is a list) of a field annotation such as `int | None`
    or `Sequence[str] | str | None`."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    for a in args:
        if typing.get_origin(a) is not None and typing.get_args(a):  # Sequence[int]
            return typing.get_args(a)[0], True
    return args[0], False


def add_options(
    group,
    cls,
    *,
    prefix: str,
    defaults: Mapping[str, Any] | None = None,
    skip: tuple[str, ...] = (),
    rename: Mapping[str, str] | None = None,
) -> None:
    """Add one option per field of dataclass `cls` to `group`; values land in
    the namespace as `prefix + field name`. `defaults` overrides the
    dataclass defaults for this command; `rename` the option names."""
    hints = typing.get_type_hints(cls)
    defaults, rename = dict(defaults or {}), dict(rename or {})
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        flag = "--" + rename.get(f.name, f.name).replace("_", "-")
        default = defaults.get(f.name, f.default)
        kind, is_list = _base_type(hints[f.name])
        kw: dict[str, Any] = dict(
            dest=prefix + f.name,
            default=default,
            help=f.metadata["help"] + " (default: %(default)s)",
        )
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif is_list:
            kw.update(action="append", type=kind, default=None)
            kw["help"] = f.metadata["help"]
        else:
            kw["type"] = {"bytes": parse_size, "json": parse_json}.get(
                f.metadata.get("parse"), kind
            )
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
        group.add_argument(flag, **kw)


def values(ns: argparse.Namespace, cls, *, prefix: str) -> dict[str, Any]:
    """The fields of `cls` found in `ns` (as added by `add_options`)."""
    out = {}
    for f in dataclasses.fields(cls):
        if hasattr(ns, prefix + f.name):
            out[f.name] = getattr(ns, prefix + f.name)
    return out


def parse_lora_module(text: str) -> tuple[str, str]:
    """One --lora-modules item: NAME=PATH, or vLLM's JSON form {"name": ...,
    "path": ...} (its "base_model_name" is accepted and not read) -> (name, path)."""
    t = text.strip()
    if t.startswith("{"):
        d = parse_json(t)
        ok = (
            isinstance(d, dict)
            and not set(d) - {"name", "path", "base_model_name"}
            and all(isinstance(d.get(k), str) and d[k] for k in ("name", "path"))
        )
        if not ok:
            raise argparse.ArgumentTypeError(
                f'{text!r}: the JSON form is {{"name": NAME, "path": PATH}}'
            )
        return d["name"], d["path"]
    name, sep, path = t.partition("=")
    if not (sep and name and path):
        raise argparse.ArgumentTypeError(
            f'{text!r}: give NAME=PATH (or JSON {{"name": NAME, "path": PATH}}}})'
        )
    return name, path


def add_lora_modules(parser) -> None:
    """--lora-modules NAME=PATH ...: LoRA adapters loaded at start (vLLM's option)."""
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) loaded at start, ids 1, 2, ... in "
        "order; a request's `model` names one (needs --enable-lora)",
    )


def lora_requests(modules) -> list:
    """--lora-modules' (name, path) pairs as LoRARequests of ids 1, 2, ...;
    ValueError for a name given twice."""
    from jaxkv.core.adapters.lora import LoRARequest

    names = [n for n, _ in modules or ()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--lora-modules: {twice} given more than once")
    return [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(modules or ())]
