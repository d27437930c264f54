"""A GGUF file's ``tokenizer.*`` metadata -> `jaxkv.tokenizer.Tokenizer`: the
BPE tokenizer is rebuilt from the vocabulary and its merges (byte-level
"gpt2") or scores (SentencePiece "llama"), with the pre-tokenizer llama.cpp
uses for ``tokenizer.ggml.pre``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from jaxkv.tokenizer import Tokenizer

# GGUF token types (llama.cpp `llama_token_type`).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_GPT2_PRE = ("gpt2", "gpt-2", "default", "mpt", "olmo", "jais")
# llama.cpp splits every numeric character on its own before the GPT-2 regex.
_DIGITS_GPT2_PRE = ("smollm", "starcoder", "refact", "codeshell")
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_PRE = {
    "llama-bpe": (_LLAMA3_SPLIT, True),
    "llama3": (_LLAMA3_SPLIT, True),
    "llama-v3": (_LLAMA3_SPLIT, True),
    "smaug-bpe": (_LLAMA3_SPLIT, True),
    "qwen2": (_QWEN2_SPLIT, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False),
}  # pre -> (split regex, BPE ignore_merges)
# Keys whose value, when present, must be a list of this type / a token id.
_LISTS = {
    "tokenizer.ggml.tokens": str,
    "tokenizer.ggml.merges": str,
    "tokenizer.ggml.scores": (int, float),
    "tokenizer.ggml.token_type": int,
}
_IDS = (
    "bos_token_id",
    "eos_token_id",
    "unknown_token_id",
    "padding_token_id",
    "eot_token_id",
    "eom_token_id",
)


def tokenizer_from_gguf(info: Mapping[str, Any]) -> Tokenizer:
    """Build from a GGUF file's ``tokenizer.*`` metadata (keys as in the file,
    e.g. ``tokenizer.ggml.tokens``). Supports ``tokenizer.ggml.model`` "gpt2"
    (byte-level BPE, with the pre-tokenizers listed in this module) and
    "llama" (SentencePiece BPE with byte fallback)."""
    for key, kind in _LISTS.items():  # a hostile file's wrong types: refused by name
        v = info.get(key)
        if v is not None and not (
            isinstance(v, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in v)
        ):
            raise ValueError(f"{key}: must be a list of {getattr(kind, '__name__', 'number')}s")
    for key in _IDS:
        v = info.get(f"tokenizer.ggml.{key}")
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"tokenizer.ggml.{key}: must be a token id, got {str(v)[:80]}")
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
        raise ValueError(
            f"tokenizer.ggml.model: unsupported tokenizer model {kind!r} "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == TOKEN_TYPE_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == TOKEN_TYPE_USER_DEFINED
        ]
    )

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
            special_tokens=sorted(
                {(tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos)) if on}
            ),
        )
    # llama.cpp also ends generation at the end-of-turn / end-of-message tokens.
    eos_ids = [
        i
        for i in (
            eos,
            token_id("tokenizer.ggml.eot_token_id"),
            token_id("tokenizer.ggml.eom_token_id"),
        )
        if i is not None
    ]
    special = {
        name: tokens[i] if (i := token_id(f"tokenizer.ggml.{key}")) is not None else None
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    return Tokenizer(
        tok,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        chat_template=info.get("tokenizer.chat_template"),
        special_tokens=special,
    )


def _byte_level_bpe(info: Mapping[str, Any], vocab: dict[str, int]) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE from the file's tokens and merges."""
    merges = [tuple(m.split(" ", 1)) for m in info.get("tokenizer.ggml.merges") or []]
    pre = info.get("tokenizer.ggml.pre", "default")
    ignore_merges = _SPLIT_PRE.get(pre, (None, False))[1]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = _gguf_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


MAX_PIECE_CHARS = 1024  # real vocabularies' longest pieces are far shorter
MAX_VOCAB_CHARS = 16 * 2**20


def _sentencepiece_bpe(
    info: Mapping[str, Any], tokens: list[str], unk: int | None
) -> tokenizers.Tokenizer:
    """SentencePiece BPE (llama.cpp "llama" vocab): spaces become U+2581, one is
    prepended to the text when ``add_space_prefix``, pieces merge highest score
    first, and characters outside the vocabulary fall back to <0xNN> byte tokens."""
    scores = info.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(
            "tokenizer.ggml.scores: a SentencePiece vocabulary needs one score per token"
        )
    longest = max(map(len, tokens), default=0)
    if longest > MAX_PIECE_CHARS or sum(map(len, tokens)) > MAX_VOCAB_CHARS:
        raise ValueError(
            f"tokenizer.ggml.tokens: pieces of up to {longest} characters, "
            f"{sum(map(len, tokens))} in all; a SentencePiece vocabulary here holds "
            f"pieces of at most {MAX_PIECE_CHARS} and {MAX_VOCAB_CHARS} in all"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges_from_scores(vocab, scores)  # work ~ sum of squared piece lengths
    tok = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = bool(info.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
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
                ranked.append(
                    (-scores[pid], -len(left), -len(right), pid, vocab[left], left, right)
                )
    ranked.sort()
    return [(r[-2], r[-1]) for r in ranked]


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre``."""
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PRE[pre][0]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted(_GPT2_PRE + _DIGITS_GPT2_PRE + tuple(_SPLIT_PRE))
    raise ValueError(f"tokenizer.ggml.pre: unsupported pre-tokenizer {pre!r} (supported: {known})")
