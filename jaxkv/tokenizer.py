"""Tokenizer: a `tokenizers.Tokenizer` plus what generation needs around it
(BOS/EOS ids, the chat template).

Sources: a Hugging Face dir (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``), jaxkv's own files (`to_files` / `from_files`), or
a GGUF file's metadata (`checkpoints.gguf_tokenizer.tokenizer_from_gguf`).

Chat templates are rendered the way transformers does it: a sandboxed jinja2
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception`` and the
special token strings (``bos_token``, ``eos_token``, ...) in scope. The rendered
prompt already contains any BOS the model wants, so encode it with
``add_special_tokens=False``.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

META_FILE = "jaxkv_tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"


def _token_str(tok: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or AddedToken dicts."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """Text <-> token ids, plus special ids and chat template rendering."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_ids: Iterable[int] = (), chat_template: str | None = None,
                 special_tokens: Mapping[str, str | None] | None = None):
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
        self.chat_template = chat_template
        # Strings the chat template may reference: bos_token, eos_token, unk_token, pad_token.
        self.special_tokens = dict(special_tokens or {})
        if bos_token_id is not None:
            self.special_tokens.setdefault("bos_token", tokenizer.id_to_token(bos_token_id))
        if self.eos_token_ids:
            self.special_tokens.setdefault("eos_token", tokenizer.id_to_token(self.eos_token_ids[0]))

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(int(token_id))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the chat template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        template = _compile_template(self.chat_template)
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        try:
            return template.render(messages=list(messages),
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    # ---------------------------------------------------------- persistence
    def to_files(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json, jaxkv_tokenizer.json (ids, token strings) and
        chat_template.jinja (when there is a template) into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "tokenizer.json").write_text(self.tokenizer.to_str(), encoding="utf-8")
        meta = {"bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids),
                "special_tokens": self.special_tokens}
        (d / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        if self.chat_template:
            (d / TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")

    @classmethod
    def from_files(cls, directory: str | os.PathLike) -> "Tokenizer":
        """Inverse of `to_files`."""
        d = Path(directory)
        try:
            meta = json.loads((d / META_FILE).read_text(encoding="utf-8"))
            tok = tokenizers.Tokenizer.from_str((d / "tokenizer.json").read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ValueError(f"{d}: missing tokenizer file {e.filename}") from None
        except Exception as e:  # tokenizers raises its own Exception type on bad JSON
            raise ValueError(f"{d}: corrupt tokenizer files ({e})") from None
        template = d / TEMPLATE_FILE
        return cls(tok, bos_token_id=meta.get("bos_token_id"), eos_token_ids=meta.get("eos_token_ids", ()),
                   chat_template=template.read_text(encoding="utf-8") if template.exists() else None,
                   special_tokens=meta.get("special_tokens"))

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> "Tokenizer":
        """From an HF dir: tokenizer.json, and when present tokenizer_config.json
        (special tokens, chat_template), chat_template.jinja and
        generation_config.json (extra eos ids)."""
        d = Path(directory)
        path = d / "tokenizer.json"
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from None
        cfg = _read_json(d / "tokenizer_config.json")
        gen = _read_json(d / "generation_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if (d / TEMPLATE_FILE).exists():
            template = (d / TEMPLATE_FILE).read_text(encoding="utf-8")
        special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos = tok.token_to_id(special["bos_token"]) if special["bos_token"] else None
        eos = []
        if special["eos_token"] and tok.token_to_id(special["eos_token"]) is not None:
            eos.append(tok.token_to_id(special["eos_token"]))
        gen_eos = gen.get("eos_token_id")
        eos.extend(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        return cls(tok, bos_token_id=bos, eos_token_ids=eos, chat_template=template,
                   special_tokens=special)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from e
