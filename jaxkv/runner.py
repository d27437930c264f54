"""The jitted step and the host-side batch builder.

    step(state, cache, batch, rng) -> (StepOutput, cache)     cache donated

The NNX model is split once (`nnx.split`) and merged inside the jitted
function. Token count T, sequence count S and the block-table width W are
padded up to buckets (`Buckets`), and the few static sampling switches
(all greedy, top-logprob count, penalties) join the compile key, so a run
compiles a bounded number of programs; `Runner.compiles` counts them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.attention import StepBatch
from jaxkv.kv_cache import KVCache, copy_pages
from jaxkv.sampling import SamplingBatch, sample


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def _pick(buckets: Sequence[int], n: int, what: str) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{what}: {n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padding targets: tokens per step, sequences per step, pages per sequence."""

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    pages: tuple[int, ...]

    @classmethod
    def make(cls, max_tokens: int, max_seqs: int, max_pages: int) -> "Buckets":
        return cls(tokens=_pow2_buckets(1, max_tokens),
                   seqs=_pow2_buckets(1, max_seqs),
                   pages=_pow2_buckets(min(4, max_pages), max_pages))


@dataclasses.dataclass
class SeqInput:
    """One sequence's share of a step, on the host."""

    token_ids: Sequence[int]  # this step's rows
    start_pos: int  # position of token_ids[0]
    block_table: Sequence[int]  # its pages, in order
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    sample_index: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    history: Sequence[int] = ()  # prompt + output tokens, for penalties
    num_prompt: int = 0  # how many of `history` are prompt tokens

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


def build_batch(seqs: Sequence[SeqInput], page_size: int, buckets: Buckets, *,
                decode_steps: int = 1):
    """Pack sequences into a padded numpy StepBatch. Returns (batch,
    all_greedy). With `decode_steps` K > 1 every sequence brings one token,
    rows and sequences share one bucket (row s is sequence s), and the block
    tables cover K more positions (pages reserved ahead)."""
    n_tok = sum(len(s.token_ids) for s in seqs)
    S = _pick(buckets.seqs, len(seqs), "sequences per step")
    T = S if decode_steps > 1 else _pick(buckets.tokens, n_tok, "tokens per step")
    kv_lens = [s.start_pos + len(s.token_ids) for s in seqs]
    W = _pick(buckets.pages, max([-(-(k + decode_steps - 1) // page_size) for k in kv_lens] + [1]),
              "pages per sequence")
    token_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slots = np.zeros(T, np.int32)
    cu = np.zeros(S + 1, np.int32)
    kvl = np.zeros(S, np.int32)
    bt = np.zeros((S, W), np.int32)
    logits_idx = np.zeros(S, np.int32)
    f32 = lambda v: np.full(S, v, np.float32)  # noqa: E731
    temp, top_p, min_p = f32(0.0), f32(1.0), f32(0.0)
    pres, freq, rep = f32(0.0), f32(0.0), f32(1.0)
    top_k = np.zeros(S, np.int32)
    seeds = np.zeros(S, np.uint32)
    sidx = np.zeros(S, np.int32)
    use_pen = any(s.uses_penalties for s in seqs)
    N = _pick(buckets.tokens + (1 << 30,), max(len(s.history) for s in seqs), "history") \
        if use_pen else 0
    hist = np.full((S, N), -1, np.int32)
    hist_out = np.zeros((S, N), bool)
    row = 0
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        if n and len(s.block_table) * page_size < kv_lens[i]:
            raise ValueError(f"sequence {i}: {kv_lens[i]} tokens but only "
                             f"{len(s.block_table)} pages")
        pos = np.arange(s.start_pos, s.start_pos + n)
        token_ids[row:row + n] = s.token_ids
        positions[row:row + n] = pos
        table = np.asarray(s.block_table, np.int32)
        slots[row:row + n] = table[pos // page_size] * page_size + pos % page_size
        bt[i, :len(table)] = table[:W]
        kvl[i] = kv_lens[i]
        row += n
        cu[i + 1] = row
        logits_idx[i] = max(row - 1, 0)
        temp[i], top_k[i], top_p[i], min_p[i] = s.temperature, s.top_k, s.top_p, s.min_p
        seeds[i], sidx[i] = s.seed & 0xFFFFFFFF, s.sample_index
        pres[i], freq[i], rep[i] = s.presence_penalty, s.frequency_penalty, s.repetition_penalty
        if use_pen and s.uses_penalties:
            h = np.asarray(s.history, np.int32)
            hist[i, :len(h)] = h
            hist_out[i, s.num_prompt:len(h)] = True
    cu[len(seqs) + 1:] = row
    sb = SamplingBatch(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seeds=seeds,
                       sample_index=sidx, presence_penalty=pres, frequency_penalty=freq,
                       repetition_penalty=rep, history=hist, history_is_output=hist_out)
    batch = StepBatch(token_ids=token_ids, positions=positions, slot_mapping=slots,
                      cu_q_lens=cu, kv_lens=kvl, block_tables=bt,
                      num_seqs=np.asarray(len(seqs), np.int32), logits_indices=logits_idx,
                      sampling=sb)
    all_greedy = all(s.temperature <= 0 for s in seqs)
    return batch, all_greedy


def _step(graphdef, state, cache: KVCache, batch: StepBatch, rng, *, all_greedy: bool,
          num_top_logprobs: int, return_logits: bool, attention: tuple):
    model = nnx.merge(graphdef, state)
    backend, window, sinks = attention
    logits, cache = model(cache, batch, attention_backend=backend, sliding_window=window,
                          num_sink_tokens=sinks)
    out = sample(logits, batch.sampling, rng, num_top_logprobs=num_top_logprobs,
                 all_greedy=all_greedy)
    return (out, logits if return_logits else None), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeStops:
    """In-jit stop rules for multi-step decode, per sequence: stop_ids[S, N]
    (end and stop token ids, -1 padded), min_tokens_left[S] (stops are
    ignored until it reaches 0), tokens_left[S] (max_tokens / context room)."""

    stop_ids: jax.Array
    min_tokens_left: jax.Array
    tokens_left: jax.Array


def _multi_step(graphdef, state, cache: KVCache, batch: StepBatch, stops: DecodeStops, rng, *,
                num_steps: int, all_greedy: bool, num_top_logprobs: int, attention: tuple):
    """Up to `num_steps` decode steps in one call: each step's sampled token
    is the next step's input; the loop ends early once every live sequence
    hit a stop. Returns ((tokens [K, S], logprob [K, S], top ids / logprobs
    [K, S, N], steps run), cache)."""
    model = nnx.merge(graphdef, state)
    backend, window, sinks = attention
    S = batch.kv_lens.shape[0]
    page_size = cache.page_size
    live = jnp.arange(S) < batch.num_seqs
    N = num_top_logprobs
    buf = (jnp.zeros((num_steps, S), jnp.int32), jnp.zeros((num_steps, S), jnp.float32),
           jnp.zeros((num_steps, S, N), jnp.int32), jnp.zeros((num_steps, S, N), jnp.float32))

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < num_steps) & ~jnp.all(done)

    def body(carry):
        i, cache, b, done, (toks, lps, tids, tlps) = carry
        logits, cache = model(cache, b, attention_backend=backend, sliding_window=window,
                              num_sink_tokens=sinks)
        out = sample(logits, b.sampling, rng, num_top_logprobs=N, all_greedy=all_greedy)
        t = out.token_ids
        toks, lps = toks.at[i].set(t), lps.at[i].set(out.logprob)
        tids, tlps = tids.at[i].set(out.top_ids), tlps.at[i].set(out.top_logprobs)
        stop_hit = jnp.any(t[:, None] == stops.stop_ids, axis=1) & (stops.min_tokens_left <= i + 1)
        done = done | stop_hit | (stops.tokens_left <= i + 1)
        pos = b.positions + 1
        page = jnp.take_along_axis(b.block_tables, (pos // page_size)[:, None], axis=1)[:, 0]
        # A finished sequence writes nothing more (its reserved pages end).
        slot = jnp.where(live & ~done, page * page_size + pos % page_size, 0)
        sb = dataclasses.replace(b.sampling, sample_index=b.sampling.sample_index + 1)
        b = dataclasses.replace(b, token_ids=t, positions=pos, slot_mapping=slot,
                                kv_lens=jnp.where(live, b.kv_lens + 1, 0), sampling=sb)
        return i + 1, cache, b, done, (toks, lps, tids, tlps)

    n, cache, _, _, bufs = jax.lax.while_loop(cond, body, (0, cache, batch, ~live, buf))
    return (bufs, n), cache


class Runner:
    """Owns the split model, the cache and the jitted step."""

    def __init__(self, model, cache: KVCache, buckets: Buckets, *, seed: int = 0,
                 attention_backend: str = "auto", sliding_window: int | None = None,
                 num_sink_tokens: int = 0):
        self.graphdef, state = nnx.split(model)
        self.config = model.config
        # Commit every array to its device up front: outputs of the step are
        # committed, and a committed/uncommitted mismatch would recompile.
        commit = functools.partial(jax.tree_util.tree_map, lambda x: jax.device_put(x, x.sharding))
        self.state = commit(state)
        self.cache = commit(cache)
        self.page_size = cache.page_size
        self.buckets = buckets
        self.rng = jax.random.key(seed)
        # Static attention options: (backend, window override, sink tokens).
        self.attention = (attention_backend, sliding_window, num_sink_tokens)
        self._step = jax.jit(_step, static_argnums=(0,), donate_argnames=("cache",),
                             static_argnames=("all_greedy", "num_top_logprobs", "return_logits",
                                              "attention"))
        self._multi = jax.jit(_multi_step, static_argnums=(0,), donate_argnames=("cache",),
                              static_argnames=("num_steps", "all_greedy", "num_top_logprobs",
                                               "attention"))
        self._copy = jax.jit(copy_pages, donate_argnums=(0,))
        self.compiled_keys: set = set()

    @property
    def compiles(self) -> int:
        """Distinct programs this runner has asked for (one compile each)."""
        return len(self.compiled_keys)

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device-side copy-on-write: copy page src -> dst for each pair."""
        if pairs:
            src = np.array([p[0] for p in pairs], np.int32)
            dst = np.array([p[1] for p in pairs], np.int32)
            self.cache = self._copy(self.cache, src, dst)

    def run(self, seqs: Sequence[SeqInput], *, num_top_logprobs: int = 0,
            return_logits: bool = False):
        """One step over `seqs`. Returns (SampleOutput as numpy, first
        len(seqs) rows; logits [len(seqs), V] numpy or None)."""
        batch, all_greedy = build_batch(seqs, self.page_size, self.buckets)
        key = (batch.token_ids.shape, batch.block_tables.shape, batch.sampling.history.shape,
               all_greedy, num_top_logprobs, return_logits)
        self.compiled_keys.add(key)
        (out, logits), self.cache = self._step(
            self.graphdef, self.state, self.cache, batch, self.rng, all_greedy=all_greedy,
            num_top_logprobs=num_top_logprobs, return_logits=return_logits,
            attention=self.attention)
        n = len(seqs)
        out = jax.tree_util.tree_map(lambda a: np.asarray(a)[:n], out)
        return out, (None if logits is None else np.asarray(logits)[:n])

    def run_decode(self, seqs: Sequence[SeqInput], stops: Sequence[tuple[Sequence[int], int, int]],
                   num_steps: int, *, num_top_logprobs: int = 0):
        """Up to `num_steps` decode steps of `seqs` (one token each, pages
        for num_steps more positions already in their block tables) in one
        jitted call. `stops[i]` = (stop token ids, min tokens left, tokens
        left). Returns (tokens [n, len(seqs)], logprobs [n, len(seqs)],
        top ids, top logprobs [n, len(seqs), N]) as numpy, n the steps run."""
        batch, all_greedy = build_batch(seqs, self.page_size, self.buckets, decode_steps=num_steps)
        S = batch.kv_lens.shape[0]
        width = _pick((4, 8, 16, 64, 256, 1024), max([len(s[0]) for s in stops] + [1]),
                      "stop token ids")
        stop_ids = np.full((S, width), -1, np.int32)
        min_left = np.zeros(S, np.int32)
        left = np.zeros(S, np.int32)
        for i, (ids, mn, mx) in enumerate(stops):
            stop_ids[i, :len(ids)] = ids
            min_left[i], left[i] = mn, mx
        st = DecodeStops(stop_ids=stop_ids, min_tokens_left=min_left, tokens_left=left)
        key = ("multi", batch.token_ids.shape, batch.block_tables.shape, stop_ids.shape,
               all_greedy, num_top_logprobs, num_steps)
        self.compiled_keys.add(key)
        (bufs, n), self.cache = self._multi(
            self.graphdef, self.state, self.cache, batch, st, self.rng, num_steps=num_steps,
            all_greedy=all_greedy, num_top_logprobs=num_top_logprobs, attention=self.attention)
        n = int(n)
        m = len(seqs)
        return tuple(np.asarray(x)[:n, :m] for x in bufs)

