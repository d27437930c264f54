"""Tokenizer: a `tokenizers.Tokenizer` plus what generation needs around it
(BOS/EOS ids, the chat template).

Sources: a Hugging Face dir (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``), jaxkv's own files (`to_files` / `from_files`), or
a GGUF file's metadata (`checkpoints.gguf_tokenizer.tokenizer_from_gguf`).
Every file is read by `read_regular_file` (regular files only, size-bounded),
which `checkpoints` uses for its own side files too: checkpoints come from
anywhere, and a FIFO or a link to /dev/zero must not hang or drown a load.

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
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

META_FILE = "jaxkv_tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
# Size bounds of checkpoint side files (real ones are far smaller: Gemma 3's
# tokenizer.json is 33 MB, its tokenizer_config.json 1.2 MB; DeepSeek-V3's
# model.safetensors.index.json 9 MB).
MAX_CONFIG_BYTES = 8 << 20  # config.json, tokenizer_config.json, manifests, templates
MAX_TOKENIZER_BYTES = 64 << 20  # tokenizer.json
MAX_INDEX_BYTES = 64 << 20  # model.safetensors.index.json, orbax's metadata


def _token_str(tok: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or AddedToken dicts."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class Tokenizer:
    """Text <-> token ids, plus special ids and chat template rendering."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
    ):
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(int(e) for e in eos_token_ids))
        self.chat_template = chat_template
        # Strings the chat template may reference: bos_token, eos_token, unk_token, pad_token.
        self.special_tokens = dict(special_tokens or {})
        if bos_token_id is not None:
            self.special_tokens.setdefault("bos_token", tokenizer.id_to_token(bos_token_id))
        if self.eos_token_ids:
            self.special_tokens.setdefault(
                "eos_token", tokenizer.id_to_token(self.eos_token_ids[0])
            )

    # ------------------------------------------------------------------ use
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def num_ids(self) -> int:
        """Largest token id + 1: the embedding rows a model needs for this
        tokenizer (more than `vocab_size` when the ids have holes)."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(int(token_id))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the chat template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        template = _compile_template(self.chat_template)
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        try:
            return template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    # ---------------------------------------------------------- persistence
    def to_files(self, directory: str | os.PathLike) -> None:
        """Write tokenizer.json, jaxkv_tokenizer.json (ids, token strings) and
        chat_template.jinja (when there is a template) into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / "tokenizer.json").write_text(self.tokenizer.to_str(), encoding="utf-8")
        meta = {
            "bos_token_id": self.bos_token_id,
            "eos_token_ids": list(self.eos_token_ids),
            "special_tokens": self.special_tokens,
        }
        (d / META_FILE).write_text(json.dumps(meta, indent=2), encoding="utf-8")
        if self.chat_template:
            (d / TEMPLATE_FILE).write_text(self.chat_template, encoding="utf-8")

    @classmethod
    def from_files(cls, directory: str | os.PathLike) -> Tokenizer:
        """Inverse of `to_files`."""
        d = Path(directory)
        meta = read_json_file(d / META_FILE)
        tok = _load_tokenizer_json(d / "tokenizer.json")
        bos, eos = meta.get("bos_token_id"), meta.get("eos_token_ids", [])
        special = meta.get("special_tokens", {})
        if not (
            _ids(eos, tok)
            and (bos is None or _ids([bos], tok))
            and isinstance(special, dict)
            and all(isinstance(v, (str, type(None))) for v in special.values())
        ):
            raise ValueError(
                f"{d / META_FILE}: corrupt tokenizer metadata (bos_token_id, "
                "eos_token_ids: token ids; special_tokens: token strings)"
            )
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=eos,
            chat_template=_read_text(d / TEMPLATE_FILE),
            special_tokens=special,
        )

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """From an HF dir: tokenizer.json, and when present tokenizer_config.json
        (special tokens, chat_template), chat_template.jinja and
        generation_config.json (extra eos ids). A present but malformed entry
        is a ValueError naming the file and the key."""
        d = Path(directory)
        tok = _load_tokenizer_json(d / "tokenizer.json")
        cfg_path, gen_path = d / "tokenizer_config.json", d / "generation_config.json"
        cfg = read_json_file(cfg_path, optional=True)
        gen = read_json_file(gen_path, optional=True)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            if not all(isinstance(t, dict) for t in template):
                raise ValueError(
                    f"{cfg_path}: chat_template: a list of {{name, template}} objects, "
                    f"got {str(template)[:80]}"
                )
            template = {t.get("name"): t.get("template") for t in template}.get("default")
        file_template = _read_text(d / TEMPLATE_FILE)
        template = file_template if file_template is not None else template
        if not isinstance(template, (str, type(None))):
            raise ValueError(
                f"{cfg_path}: chat_template: must be a string, got {str(template)[:80]}"
            )
        special = {
            k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        for k, v in special.items():
            if not isinstance(v, (str, type(None))):
                raise ValueError(
                    f'{cfg_path}: {k}: must be a token string or {{"content": ...}}, '
                    f"got {str(cfg.get(k))[:80]}"
                )
        bos = tok.token_to_id(special["bos_token"]) if special["bos_token"] else None
        eos = []
        if special["eos_token"] and tok.token_to_id(special["eos_token"]) is not None:
            eos.append(tok.token_to_id(special["eos_token"]))
        gen_eos = gen.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
        if not _ids(gen_eos, tok):
            raise ValueError(
                f"{gen_path}: eos_token_id: must be a token id or a list of them "
                f"(below {tok.get_vocab_size(with_added_tokens=True)}), "
                f"got {str(gen.get('eos_token_id'))[:80]}"
            )
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=eos + gen_eos,
            chat_template=template,
            special_tokens=special,
        )


def read_regular_file(path: str | os.PathLike, max_bytes: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of ``path``, which must be a regular file of at most
    ``max_bytes`` (symlinks followed).

    Checkpoint side files come with the checkpoint and may be hostile: a FIFO
    blocks its reader forever and a device (a link to /dev/zero) or a huge
    file is read without end. Anything but a regular file is a ValueError
    naming it, also where the file is optional (a FIFO where
    generation_config.json belongs is a broken checkpoint, not a missing
    file), and so is a file over the bound. FileNotFoundError passes
    through, for callers whose file is optional; other OS errors become a
    ValueError naming the file."""
    path = Path(path)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(
                f"{path}: not a regular file ({_file_kind(st.st_mode)}); refusing to read "
                "it (checkpoint files must be regular files, optional ones too)"
            )
        if st.st_size > max_bytes:
            raise ValueError(
                f"{path}: {st.st_size} bytes, larger than the {max_bytes / (1 << 20):g} MiB "
                "limit for this file"
            )
        # O_NONBLOCK: if a FIFO replaced the file since the stat, opening it
        # must not wait for a writer; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"{path}: not a regular file; refusing to read it")
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise ValueError(
            f"{path}: larger than the {max_bytes / (1 << 20):g} MiB limit for this file"
        )
    return data


def read_json_file(
    path: str | os.PathLike, max_bytes: int = MAX_CONFIG_BYTES, *, optional: bool = False
) -> dict:
    """A JSON object from a regular file of at most ``max_bytes``
    (`read_regular_file`); ``{}`` for an absent ``optional`` file. Missing
    (when required), corrupt, too deeply nested or not an object: a
    ValueError naming the file."""
    path = Path(path)
    try:
        data = json.loads(read_regular_file(path, max_bytes).decode("utf-8"))
    except FileNotFoundError:
        if optional:
            return {}
        raise ValueError(f"{path}: not found") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: corrupt JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: corrupt JSON (not an object)")
    return data


def _read_text(path: Path) -> str | None:
    """A bounded UTF-8 text file (a chat template), None when absent."""
    try:
        return read_regular_file(path).decode("utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None


def _load_tokenizer_json(path: Path) -> tokenizers.Tokenizer:
    try:
        data = read_regular_file(path, MAX_TOKENIZER_BYTES)
    except FileNotFoundError:
        raise ValueError(f"{path}: missing tokenizer file") from None
    try:
        return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own Exception type on bad JSON
        raise ValueError(f"{path}: cannot load tokenizer ({str(e)[:200]})") from None


def _ids(values: Any, tok: tokenizers.Tokenizer) -> bool:
    """Whether ``values`` is a list of token ids of ``tok``."""
    n = tok.get_vocab_size(with_added_tokens=True)
    return isinstance(values, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n for v in values
    )


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; chat templates want plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template does not compile: {e}") from e
