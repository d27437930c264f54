"""Token rules of a request, on the host: structured outputs (a JSON schema,
a regex, a choice list, a Lark grammar), allowed token ids, bad words,
logit bias.

Grammars are compiled by llguidance (the grammar engine vLLM and SGLang
also offer; chosen because it needs nothing else: xgrammar pulls in torch
and triton, outlines-core covers regex and JSON only). `Grammars` compiles a
spec once per engine and caches the compiled matcher; each sequence gets
its own copy (`TokenRules`), advanced as its tokens are accepted.

Every step, each rule-bound sequence fills one row of a packed bitmask
[S, ceil(V / 32)] int32 (bit v of row s: token v allowed); the sampler
applies it, and the bias pairs, before any other rule
(`jaxkv.worker.sampler.sample_with_rules`). Sequences with rules run one
decode step per call, since the next mask depends on the token sampled.
"""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CHOICES = 10_000  # a choice list compiles to one regex: fast at this size
MAX_CHOICE_CHARS = 1_000_000
PROBE_TOKENS = 8  # tokens a new grammar is walked at intake (errors show there, not mid-answer)
# A grammar, regex or JSON schema a client writes: llguidance compiles it
# recursively, and a long chain of rules (a 45 KB Lark grammar of 3,000
# rules) overflows a thread's 8 MB stack and ends the process. So sources
# are bounded, compiled on a thread with a large stack, given a time bound,
# and refused when one token's mask costs more than a step can afford.
MAX_GRAMMAR_CHARS = 128 * 1024
COMPILE_STACK_BYTES = 512 << 20  # address space only: pages are touched as the recursion needs
COMPILE_SECONDS = 10.0
MAX_MASK_SECONDS = 0.05  # a token's mask, at intake's probe
_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def grammar_error(matcher) -> str:
    """A matcher's error, first line only (llguidance appends its parser
    state, kilobytes of it)."""
    text = (matcher.get_error() or "rejected").strip().splitlines()[0]
    return text if len(text) <= 300 else text[:300] + "..."


def check_spec(spec: Any) -> None:
    """ValueError naming `structured_outputs` unless `spec` has the right
    form (whether a grammar compiles is checked by `Grammars`)."""
    if not isinstance(spec, dict):
        raise ValueError(
            f"structured_outputs: must be an object with one of {', '.join(KINDS)}, "
            f"got {type(spec).__name__}"
        )
    kinds = [k for k in KINDS if spec.get(k) is not None]
    extra = sorted(set(spec) - set(KINDS))
    if len(kinds) != 1 or extra:
        raise ValueError(
            f"structured_outputs: needs exactly one of {', '.join(KINDS)}"
            + (f" (unknown: {', '.join(map(str, extra))})" if extra else "")
        )
    kind, v = kinds[0], spec[kinds[0]]
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"structured_outputs: json is not a valid JSON schema ({e})"
                ) from None
        if not isinstance(v, (dict, bool)):
            raise ValueError("structured_outputs: json must be a JSON schema object")
        n = len(json.dumps(v))
        if n > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"structured_outputs: json schema of {n} characters; at most "
                f"{MAX_GRAMMAR_CHARS} are compiled"
            )
    elif kind in ("regex", "grammar"):
        if not isinstance(v, str) or not v:
            raise ValueError(f"structured_outputs: {kind} must be a non-empty string")
        if len(v) > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"structured_outputs: {kind} of {len(v)} characters; at most "
                f"{MAX_GRAMMAR_CHARS} are compiled"
            )
    elif kind == "choice":
        if (
            not isinstance(v, (list, tuple))
            or not v
            or not all(isinstance(c, str) and c for c in v)
        ):
            raise ValueError(
                "structured_outputs: choice must be a non-empty list of non-empty strings"
            )
        if len(v) > MAX_CHOICES or sum(map(len, v)) > MAX_CHOICE_CHARS:
            raise ValueError(
                f"structured_outputs: choice has {len(v)} entries of "
                f"{sum(map(len, v))} characters; at most {MAX_CHOICES} entries "
                f"and {MAX_CHOICE_CHARS} characters"
            )
    elif v is not True:
        raise ValueError("structured_outputs: json_object must be true")


def grammar_source(spec: dict) -> str:
    """The llguidance grammar of a checked spec."""
    from llguidance import LLMatcher

    kind = next(k for k in KINDS if spec.get(k) is not None)
    v = spec[kind]
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(json.loads(v) if isinstance(v, str) else v)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "regex":
        return LLMatcher.grammar_from_regex(v)
    if kind == "choice":  # one regex: the lexer's automaton, not thousands of parser items
        return LLMatcher.grammar_from_regex(
            "("
            + "|".join("".join("\\" + ch if ch in _REGEX_META else ch for ch in c) for c in v)
            + ")"
        )
    return LLMatcher.grammar_from_lark(v)


class Grammars:
    """Compiles structured-output specs for one tokenizer and caches them
    (safe to call from several threads: a server compiles in its handlers,
    before the engine thread needs the grammar)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], size: int = 128):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lltok = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def _ll_tokenizer(self):
        if self._lltok is None:
            try:
                import llguidance
            except ImportError:
                raise ValueError(
                    "structured_outputs: needs the llguidance package (pip install llguidance)"
                ) from None
            if self._tokenizer is None:
                raise ValueError("structured_outputs: this model has no tokenizer")
            try:
                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.tokenizer.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=self._eos[0] if self._eos else None,
                )
            except (ValueError, TypeError, RuntimeError) as e:
                raise ValueError(
                    f"structured_outputs: llguidance cannot use this model's tokenizer ({e})"
                ) from None
        return self._lltok

    def matcher(self, spec: dict):
        """A fresh matcher of `spec` (its own state); ValueError if the
        grammar does not compile."""
        from llguidance import LLMatcher

        with self._lock:
            lltok = self._ll_tokenizer()
        try:
            src = grammar_source(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs: {e}") from None
        with self._lock:
            m = self._cache.get(src)
            if m is not None:
                self._cache.move_to_end(src)
                return m.deep_copy()

        # Compiled outside the lock: a large grammar in a server's handler
        # thread never stalls the engine thread's lookups.
        def compile_and_probe():
            m = LLMatcher(lltok, src, log_level=0)
            if m.is_error():
                raise ValueError(f"structured_outputs: {grammar_error(m)}")
            self._probe(m.deep_copy())
            return m

        m = on_large_stack(compile_and_probe, COMPILE_SECONDS)
        with self._lock:
            self._cache[src] = m
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return m.deep_copy()

    def _probe(self, m) -> None:
        """Walk a new grammar's first tokens (the lowest allowed each time):
        a grammar too complex for the parser fails here, at intake, not
        after the answer's first token."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        mask = allocate_token_bitmask(1, self.vocab_size)
        for _ in range(PROBE_TOKENS):
            t0 = time.perf_counter()
            fill_next_token_bitmask(m, mask, 0)
            if time.perf_counter() - t0 > MAX_MASK_SECONDS:
                raise ValueError(
                    f"structured_outputs: the grammar is too complex (one token's "
                    f"mask took over {MAX_MASK_SECONDS * 1000:.0f} ms)"
                )
            words = np.flatnonzero(mask[0])
            if not m.is_error() and len(words) and not m.is_stopped():
                w = int(words[0])
                t = w * 32 + (int(mask[0][w]) & -int(mask[0][w])).bit_length() - 1
                if t < self.vocab_size and m.consume_token(t):
                    continue
            if m.is_error():
                raise ValueError(
                    f"structured_outputs: the grammar is too complex or invalid "
                    f"({grammar_error(m)})"
                )
            return


_STACK_LOCK = threading.Lock()


def on_large_stack(fn, timeout: float):
    """fn() on a new thread whose stack is `COMPILE_STACK_BYTES`; its result
    or exception. ValueError when it runs past `timeout` seconds (the
    thread finishes on its own; its result is dropped)."""
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["err"] = e

    with _STACK_LOCK:
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            t = threading.Thread(target=run, name="jaxkv-grammar", daemon=True)
            t.start()
        finally:
            threading.stack_size(old)
    t.join(timeout)
    if t.is_alive():
        raise ValueError(
            f"structured_outputs: the grammar is too complex (compiling it took over {timeout:g} s)"
        )
    if "err" in box:
        raise box["err"]
    return box["out"]


def mask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def _bits(ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """Packed row with bit t (bit t % 32 of word t // 32) set for each id."""
    row = np.zeros(mask_width(vocab_size) * 32, bool)
    row[list(ids)] = True
    return np.packbits(row, bitorder="little").view("<i4")


class TokenRules:
    """One sequence's rules: a grammar matcher, an allowed-token mask,
    bad-word token sequences and logit bias pairs."""

    def __init__(self, params, grammars: Grammars | None, tokenizer, vocab_size: int):
        so = params.structured_outputs
        self.matcher = grammars.matcher(so) if so is not None else None
        self.allowed = (
            _bits(params.allowed_token_ids, vocab_size) if params.allowed_token_ids else None
        )
        bad = set()
        for w in params.bad_words or ():
            if tokenizer is None:
                raise ValueError("bad_words: this model has no tokenizer")
            for text in (w, " " + w):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if ids:
                    bad.add(tuple(ids))
        self.bad_words = sorted(bad)
        self.bias = params.logit_bias_pairs
        self.error: str | None = None  # the grammar's, once it fails

    def fill(self, bitmask: np.ndarray, row: int, output_ids: Sequence[int]) -> bool:
        """Write this sequence's allowed tokens into `bitmask[row]` (all ones
        on entry); False if no token is allowed."""
        if self.matcher is not None:
            from llguidance.numpy import fill_next_token_bitmask

            fill_next_token_bitmask(self.matcher, bitmask, row)
            if self.matcher.is_error():
                self.error = grammar_error(self.matcher)
        if self.allowed is not None:
            bitmask[row] &= self.allowed
        words = bitmask[row].view(np.uint32)
        for seq in self.bad_words:  # ban a word's last token once its start is out
            k = len(seq) - 1
            if len(output_ids) >= k and tuple(output_ids[len(output_ids) - k :]) == seq[:-1]:
                t = seq[-1]
                words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
        return bool(bitmask[row].any())

    def accept(self, token: int) -> str | None:
        """Advance past a sampled token: None, "stop" (the grammar is
        complete) or an error message."""
        if self.matcher is None:
            return None
        if not self.matcher.consume_token(int(token)):
            return (
                f"structured_outputs: token {token} was sampled outside the grammar "
                f"({grammar_error(self.matcher)})"
            )
        return "stop" if self.matcher.is_stopped() else None
