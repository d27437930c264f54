"""Importance eviction (`kv_eviction="snapkv"` / `"h2o"`): the device's
score pass against a float64 softmax over hand-built queries and keys, the
kept sets of hand-built attention patterns, compaction against a numpy
gather, positions running on past the kv indices, and engines whose
budgets are honoured, whose freed pages are reused and whose outputs are
those of each prompt run alone (and, with a budget no prompt reaches, of
an engine without eviction)."""

import dataclasses

import numpy as np
import pytest

from jaxkv.config import EngineConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.kv.evict import h2o_keep, snapkv_keep
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama
from tests.helpers.sharding_worker import ENGINE, TINY

MODEL = dataclasses.replace(TINY, num_layers=2)
PS = 8


def _batch(kv_lens, q_lens, tables, score_from):
    from types import SimpleNamespace

    import jax.numpy as jnp

    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    T = int(cu[-1]) + 3  # three padding rows
    cu_pad = np.concatenate([cu, np.full(1, T, np.int32)])  # one padding sequence slot
    return SimpleNamespace(
        cu_q_lens=jnp.asarray(cu_pad),
        kv_lens=jnp.asarray(list(kv_lens) + [0], jnp.int32),
        block_tables=jnp.asarray(np.vstack([tables, np.zeros_like(tables[:1])]), jnp.int32),
        num_seqs=jnp.asarray(len(q_lens), jnp.int32),
        score_from=jnp.asarray(list(score_from) + [1 << 30], jnp.int32),
    ), T


@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_score_pass_equals_a_float64_softmax(fmt):
    """Two sequences (a prefill chunk and a decode row) over paged keys:
    the scores added to each slot are the float64 softmax weights of the
    scored rows, summed over the query heads of each KV head."""
    import jax.numpy as jnp

    from jaxkv.model.kv_scores import accumulate_scores
    from pallas_kernels.ragged_paged_attention.kv_formats import quantize_vectors

    rng = np.random.default_rng(3)
    KVH, G, D, P = 2, 3, 16, 12
    keys = rng.standard_normal((KVH, P, PS, D)).astype(np.float32)
    tables = np.array([[3, 7, 1, 0], [5, 9, 0, 0]], np.int32)
    kv_lens, q_lens, score_from = [20, 11], [6, 1], [17, 0]
    batch, T = _batch(kv_lens, q_lens, tables, score_from)
    q = rng.standard_normal((T, KVH * G, D)).astype(np.float32)
    if fmt == "int8":
        kp, ks = quantize_vectors(jnp.asarray(keys), "int8")
        kd = np.asarray(kp, np.float64) * np.asarray(ks, np.float64)[..., None]
    else:
        kp, ks, kd = jnp.asarray(keys), None, keys.astype(np.float64)
    got = np.asarray(
        accumulate_scores(
            jnp.zeros((KVH, P, PS), jnp.float32),
            jnp.asarray(q),
            kp,
            ks,
            batch,
            sm_scale=0.25,
            max_rows=8,
        )
    )
    want = np.zeros((KVH, P, PS))
    row = 0
    for s in range(2):
        n = kv_lens[s]
        k = kd[:, tables[s]].reshape(KVH, -1, D)[:, :n]  # [KVH, n, D]
        for i in range(q_lens[s]):
            pos = n - q_lens[s] + i
            if pos >= score_from[s]:
                qs = q[row + i].astype(np.float64).reshape(KVH, G, D)
                logits = np.einsum("kgd,kjd->kgj", qs, k[:, : pos + 1]) * 0.25
                w = np.exp(logits - logits.max(-1, keepdims=True))
                w = (w / w.sum(-1, keepdims=True)).sum(1)  # [KVH, pos + 1]
                for j in range(pos + 1):
                    want[:, tables[s, j // PS], j % PS] += w[:, j]
        row += q_lens[s]
    want[:, 0] = got[:, 0]  # the trash page takes whatever padding adds
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert got[:, 3].sum() > 0 and got[:, 5].sum() > 0


def test_kept_sets_of_hand_built_attention_patterns():
    n = 40
    s = np.full((1, 2, n), 0.01)
    s[0, 0, 10] = 5.0  # head 0: one strong token; pooled, its neighbours come along
    s[0, 1, [2, 25]] = 3.0  # head 1: two
    keep = snapkv_keep(s, n, budget=16, window=4)  # 4 of the window + the 12 best pooled
    assert keep.shape == (1, 2, 16)
    window = set(range(36, 40))
    assert set(keep[0, 0]) == set(range(7, 14)) | set(range(0, 5)) | window  # ties: earliest
    assert set(keep[0, 1]) == set(range(0, 6)) | set(range(22, 28)) | window
    assert np.all(np.diff(keep, axis=-1) > 0)  # in order
    h = np.zeros((1, 1, n))
    h[0, 0, [3, 17, 30]] = [2.0, 1.0, 3.0]
    keep = h2o_keep(h, n, keep=8)  # 4 recent, 4 heavy hitters
    assert list(keep[0, 0]) == [0, 3, 17, 30, 36, 37, 38, 39]


def test_compaction_moves_each_heads_kept_tokens_to_the_first_slots():
    import jax.numpy as jnp

    from jaxkv.config import CacheConfig
    from jaxkv.model.kv_cache import create_cache
    from jaxkv.model.kv_scores import compact_pages

    cache = create_cache(
        MODEL, CacheConfig(num_pages=10, page_size=PS, kv_dtype="int8", scores=True)
    )
    rng = np.random.default_rng(0)
    fill = lambda t: tuple(
        jnp.asarray(rng.integers(-9, 9, x.shape).astype(x.dtype))  # noqa: E731
        for x in t
    )
    cache = dataclasses.replace(
        cache,
        k=fill(cache.k),
        v=fill(cache.v),
        k_scale=fill(cache.k_scale),
        scores=fill(cache.scores),
    )
    table = np.array([4, 2, 8, 0], np.int32)
    L, KVH = MODEL.num_layers, MODEL.num_kv_heads
    src = np.stack(
        [
            np.stack([np.sort(rng.choice(20, 10, replace=False)) for _ in range(KVH)])
            for _ in range(L)
        ]
    ).astype(np.int32)
    src = np.concatenate([src, np.zeros((L, KVH, 2), np.int32)], axis=-1)  # 2 padding
    out = compact_pages(cache, jnp.asarray(table), jnp.asarray(src), jnp.int32(10))
    for name in ("k", "v", "k_scale", "scores"):
        for layer in range(L):
            old = np.asarray(getattr(cache, name)[layer])
            new = np.asarray(getattr(out, name)[layer])
            flat_old = old[:, table].reshape((KVH, -1) + old.shape[3:])
            flat_new = new[:, table].reshape((KVH, -1) + old.shape[3:])
            for h in range(KVH):
                np.testing.assert_array_equal(flat_new[h, :10], flat_old[h, src[layer, h, :10]])
                np.testing.assert_array_equal(flat_new[h, 10:24], flat_old[h, 10:24])
            untouched = [p for p in range(1, 10) if p not in table]
            np.testing.assert_array_equal(new[:, untouched], old[:, untouched])


def test_positions_run_on_past_the_kv_indices():
    """A plan's pos_offset moves RoPE positions only: slots, kv_lens and
    the block table stay in kv indices."""
    from jaxkv.worker.buckets import ProgramKey
    from jaxkv.worker.plan import StepPlan
    from jaxkv.worker.step_batch import empty, pack

    b0 = empty(ProgramKey("mixed", 8, 2), 4)
    plan = StepPlan(
        token_ids=np.arange(4, dtype=np.int32),
        starts=np.array([9, 20], np.int32),
        q_lens=np.array([3, 1], np.int32),
        num_spec=np.zeros(2, np.int32),
        prev_index=np.full(2, -1, np.int32),
        block_tables=np.array([[5, 6, 0, 0], [2, 3, 7, 0]], np.int32),
        num_output=np.zeros(2, np.int32),
        sampling=b0.sampling,
        stops=b0.stops,
        pos_offset=np.array([100, 7], np.int32),
        score_from=np.array([10, 0], np.int32),
    )
    b = pack(plan, ProgramKey("mixed", 8, 2), PS, 4)
    assert list(b.positions[:4]) == [109, 110, 111, 27]
    assert list(b.slot_mapping[:4]) == [6 * PS + 1, 6 * PS + 2, 6 * PS + 3, 7 * PS + 4]
    assert list(b.kv_lens[:2]) == [12, 21] and list(b.score_from[:2]) == [10, 0]


@pytest.fixture(scope="module")
def model():
    return Llama.random_init(MODEL, seed=1)


def _prompts(*lengths):
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(1, MODEL.vocab_size, n)] for n in lengths]


def _engine(model, **kw):
    return LLMEngine(
        model,
        None,
        EngineConfig(**{**ENGINE, "num_pages": 48, "enable_prefix_caching": False, **kw}),
    )


def _run(eng, ps, max_tokens=24):
    """(greedy tokens of each prompt, the most pages any sequence held after each step)."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0)) for p in ps]
    held, final = [], {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        held.append(max([s.progress.num_pages for s in eng.scheduler.running] or [0]))
    return [final[i].outputs[0].token_ids for i in ids], held


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_budgets_honoured_pages_reused_and_batched_equals_lone(model, method):
    ps = _prompts(60, 45, 20)
    kw = dict(kv_eviction=method, kv_budget=32, snapkv_window=8)
    eng = _engine(model, **kw)
    free0 = eng.bm.num_free_pages
    got, held = _run(eng, ps)
    m = eng.kv_metrics()
    assert m["evicted_tokens"] > 0 and m["eviction_cuts"] >= 2, m
    assert eng.bm.num_free_pages == free0  # every page came back
    if method == "h2o":  # never more than the budget (and the row being written)
        assert max(held) <= 32 // PS + 1, held
    else:  # the prompt is cut to the budget; decoding then grows from it
        assert held[1] <= 32 // PS + 1, held
    lone = [_run(_engine(model, **kw), [p])[0][0] for p in ps]
    assert got == lone
    assert got == _run(_engine(model, **kw), ps)[0]  # deterministic
    plain = [_run(_engine(model), [p])[0][0] for p in ps]
    assert got[0] != plain[0]  # the 60-token prompt lost tokens: its answer moves


def test_a_budget_no_sequence_reaches_changes_nothing(model):
    ps = _prompts(30, 17)
    got = _run(_engine(model, kv_eviction="h2o", kv_budget=96), ps)[0]
    assert got == _run(_engine(model), ps)[0]


def test_what_eviction_does_not_serve_is_refused_by_name(model):
    with pytest.raises(ValueError, match="kv_budget"):
        EngineConfig(kv_eviction="snapkv")
    with pytest.raises(ValueError, match="snapkv_window"):
        EngineConfig(kv_eviction="snapkv", kv_budget=32, snapkv_window=32, page_size=8)
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(
            kv_eviction="h2o",
            kv_budget=64,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="host tier"):
        EngineConfig(kv_eviction="h2o", kv_budget=64, kv_offload_memory="1GB")
    eng = _engine(model, kv_eviction="h2o", kv_budget=32)
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=2, n=2))
    out = eng.run_to_completion([rid])[rid]
    assert out.outputs[0].finish_reason == "error" and "n > 1" in out.error
