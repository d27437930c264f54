"""mkdocs hook: the command-line reference (`reference/cli.md`) is written
from the `jaxkv` command's own parser at build time, so an engine or
sampling option (a field of `EngineConfig` or `SamplingParams`, turned
into a flag by `jaxkv.entrypoints.cli_options`) needs no second edit."""

from __future__ import annotations

import argparse

MARKER = "<!-- cli-reference -->"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_reference())


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest.upper()}`"
    names = list(action.option_strings)
    if isinstance(action, argparse.BooleanOptionalAction):
        names = [n for n in names if not n.startswith("--no-")]
        return " / ".join(f"`{n}`" for n in names) + " (`--no-...` to turn off)"
    return ", ".join(f"`{n}`" for n in names)


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(default)" in text:
        try:
            text = text % {"default": action.default}
        except (TypeError, ValueError, KeyError):
            pass
    if action.choices and "choices" not in text:
        text += f" (choices: {', '.join(map(str, action.choices))})"
    return _cell(text)


def cli_reference() -> str:
    from jaxkv.entrypoints.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._choices_actions}
    out = []
    for name, p in sub.choices.items():
        out.append(f"## `jaxkv {name}`\n")
        if helps.get(name):
            out.append(_cell(helps[name]).capitalize() + ".\n")
        if p.description:
            out.append(_cell(p.description) + "\n")
        for group in p._action_groups:
            actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
            if not actions:
                continue
            title = {"positional arguments": "Arguments", "options": "Options"}.get(
                group.title, (group.title or "Options").capitalize()
            )
            out.append(f"### {title}\n")
            out.append("| option | what it does |\n|---|---|")
            out.extend(f"| {_flags(a)} | {_help(a)} |" for a in actions)
            out.append("")
    return "\n".join(out)
