"""Tokenizer: a `tokenizers.Tokenizer` plus what generation needs around it
(BOS/EOS ids, the chat template).

Sources: a Hugging Face dir (``tokenizer.json``, ``tokenizer_config.json``,
``generation_config.json``), a GGUF file's ``tokenizer.*`` metadata (the BPE
tokenizer is rebuilt from the vocabulary and its merges or scores, with the
pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre``), or jaxkv's own files
(`to_files` / `from_files`).

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
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_GPT2_PRE = ("gpt2", "gpt-2", "default", "mpt", "olmo", "jais")
# llama.cpp splits every numeric character on its own before the GPT-2 regex.
_DIGITS_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_PRE = {
    "llama-bpe": (_LLAMA3_SPLIT, True), "llama3": (_LLAMA3_SPLIT, True),
    "llama-v3": (_LLAMA3_SPLIT, True), "smaug-bpe": (_LLAMA3_SPLIT, True),
    "qwen2": (_QWEN2_SPLIT, False), "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}  # pre -> (split regex, BPE ignore_merges)

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

    @classmethod
    def from_gguf(cls, info: Mapping[str, Any]) -> "Tokenizer":
        """Build from a GGUF file's ``tokenizer.*`` metadata (keys as in the file,
        e.g. ``tokenizer.ggml.tokens``). Supports ``tokenizer.ggml.model`` "gpt2"
        (byte-level BPE, with the pre-tokenizers listed in this module) and
        "llama" (SentencePiece BPE with byte fallback)."""
        kind = info.get("tokenizer.ggml.model")
        tokens = list(info.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ValueError("tokenizer.ggml.tokens: missing or empty")
        types = list(info.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError("tokenizer.ggml.tokens: duplicate tokens in the vocabulary")

        def token_id(key):
            v = info.get(key)
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        if kind == "gpt2":
            tok = _byte_level_bpe(info, vocab)
        elif kind == "llama":
            tok = _sentencepiece_bpe(info, tokens, token_id("tokenizer.ggml.unknown_token_id"))
        else:
            raise ValueError(f"tokenizer.ggml.model: unsupported tokenizer model {kind!r} "
                             "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL])
        tok.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED])

        bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
        # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise.
        add_bos = bool(info.get("tokenizer.ggml.add_bos_token", kind == "llama")) and bos is not None
        add_eos = bool(info.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
        if add_bos or add_eos:
            b = [tokens[bos]] if add_bos else []
            e = [tokens[eos]] if add_eos else []
            tok.post_processor = processors.TemplateProcessing(
                single=b + ["$A"] + e,
                pair=b + ["$A"] + e + [f"{x}:1" for x in b] + ["$B:1"] + [f"{x}:1" for x in e],
                special_tokens=sorted({(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on}))
        # llama.cpp also ends generation at the end-of-turn / end-of-message tokens.
        eos_ids = [i for i in (eos, token_id("tokenizer.ggml.eot_token_id"),
                               token_id("tokenizer.ggml.eom_token_id")) if i is not None]
        special = {name: tokens[i] if (i := token_id(f"tokenizer.ggml.{key}")) is not None else None
                   for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                     ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
        return cls(tok, bos_token_id=bos, eos_token_ids=eos_ids,
                   chat_template=info.get("tokenizer.chat_template"), special_tokens=special)


def _byte_level_bpe(info: Mapping[str, Any], vocab: dict[str, int]) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE from the file's tokens and merges."""
    merges = [tuple(m.split(" ", 1)) for m in info.get("tokenizer.ggml.merges") or []]
    pre = info.get("tokenizer.ggml.pre", "default")
    ignore_merges = _SPLIT_PRE.get(pre, (None, False))[1]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = _gguf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(info: Mapping[str, Any], tokens: list[str], unk: int | None) -> tokenizers.Tokenizer:
    """SentencePiece BPE (llama.cpp "llama" vocab): spaces become U+2581, one is
    prepended to the text when ``add_space_prefix``, pieces merge highest score
    first, and characters outside the vocabulary fall back to <0xNN> byte tokens."""
    scores = info.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("tokenizer.ggml.scores: a SentencePiece vocabulary needs one score per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges_from_scores(vocab, scores)
    tok = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=merges, unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True, byte_fallback=True))
    prefix = bool(info.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a piece into two
    vocabulary pieces is a merge; merges producing higher-scored pieces rank first
    (ties: longer left part, longer right part, then vocabulary order)."""
    ranked = []
    for piece, pid in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[pid], -len(left), -len(right), pid, vocab[left], left, right))
    ranked.sort()
    return [(r[-2], r[-1]) for r in ranked]


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre``."""
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre][0]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = sorted(_GPT2_PRE + _DIGITS_GPT2_PRE + tuple(_SPLIT_PRE))
    raise ValueError(f"tokenizer.ggml.pre: unsupported pre-tokenizer {pre!r} (supported: {known})")


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
