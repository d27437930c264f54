"""Prefix-cache hits with the hybrid KV pool (jaxkv.core.scheduling.seats): a hit
keeps only the pages whose sliding-layer window still sits in some ring,
seats the sequence where that window already is, or copies it there; the
tokens are those of a lone engine with no prefix cache and every page kept."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.core.sampling_params import SamplingParams
from jaxkv.core.scheduling.page_pool import ROOT_HASH, hash_page
from jaxkv.core.scheduling.seats import Seats
from tests.helpers.model_utils import small_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class _Seq:
    def __init__(self, rid, hashes, reserved):
        self.request_id, self.ring_base = rid, 0
        self.progress = type("P", (), {})()
        self.progress.hashes, self.progress.num_reserved = hashes, reserved


def _chain(tokens, ps):
    out, parent = [], ROOT_HASH
    for i in range(len(tokens) // ps):
        parent = hash_page(parent, tokens[i * ps : (i + 1) * ps])
        out.append(parent)
    return out


def test_seats_cap_hits_to_the_window_still_held_and_seat_them_in_place():
    ps, R, W = 4, 4, 6  # a query at page k reads pages from (4k - 5) // 4 on
    seats = Seats(2, R, ps, W)
    h = _chain(list(range(40)), ps)  # 10 pages
    a = _Seq("a", h[:6], 24)
    seats.take(a)
    assert a.ring_base == 1  # the first free seat
    seats.label(a, 0)  # pages 0..5 computed; 2..5 hold the ring's slots 2, 3, 0, 1
    assert seats.hit_cap(h[:6]) == 6  # window of page 6: pages 4, 5
    assert seats.hit_cap(h[:3]) == 0  # page 2 needs page 1: overwritten by page 5
    assert seats.hit_cap(h[:5]) == 5
    seats.written(a, 24, 26)  # page 6 lands on slot 2: page 2 is gone
    assert seats.hit_cap(h[:6]) == 6 and seats.hit_cap(h[:4]) == 0
    seats.free(a)
    b = _Seq("b", [], 0)
    seats.take(b, h[:6])  # a's freed seat holds pages 4, 5 in place: no copy
    assert b.ring_base == 1 and seats.take_copies() == [] and seats.pages_in_place == 2
    # A third sequence hitting the same prefix copies them from b's ring.
    seats.free(b)
    c = _Seq("c", [], 0)
    seats.take(c)  # the seat holding no label is taken first
    assert c.ring_base == 1 + R
    seats.free(c)
    d, e = _Seq("d", [], 0), _Seq("e", [], 0)
    seats.take(e, h[:6])
    assert e.ring_base == 1  # in place again
    seats.take(d, h[:6])  # the other seat: pages 4, 5 copied from e's ring
    assert d.ring_base == 1 + R
    assert sorted(seats.take_copies()) == [(1 + 0, 1 + R + 0), (1 + 1, 1 + R + 1)]


def test_a_label_is_not_set_where_a_reserved_write_already_landed():
    seats = Seats(1, 2, 4, 4)
    h = _chain(list(range(16)), 4)
    a = _Seq("a", h[:2], 12)  # overlapped: positions below 12 reserved, page 0's slot rewritten
    seats.take(a)
    seats.label(a, 0)
    assert seats.hit_cap(h[:2]) == 2 and seats.hit_cap(h[:1]) == 0


def _lone(model, prompts):
    eng = small_engine(
        model, max_num_seqs=1, enable_prefix_caching=False, hybrid_kv_cache=False, num_pages=40
    )
    out = []
    for p in prompts:
        rid = eng.add_request(p, GREEDY)
        out.append(eng.run_to_completion([rid])[rid].outputs[0].token_ids)
    return out


@pytest.mark.parametrize("extra", [{}, dict(async_scheduling=True)], ids=["plain", "overlapped"])
def test_hits_follow_the_window_still_in_a_ring_and_give_the_lone_runs_tokens(small_model, extra):
    # window 8, pages of 8, a ring of 8 pages: a 100-token prompt overwrote
    # the window of its own first pages, so a prompt sharing only those hits
    # nothing in the hybrid pool; the next turn of a's conversation (its
    # prompt, its answer, more) hits the window a's freed seat still holds.
    rng = np.random.default_rng(4)
    a = list(map(int, rng.integers(0, 97, 100)))
    b = a[:40] + list(map(int, rng.integers(0, 97, 9)))
    more = list(map(int, rng.integers(0, 97, 5)))
    got, cached = {}, {}
    for hybrid in (False, True):
        eng = small_engine(small_model, hybrid_kv_cache=hybrid, num_pages=60, **extra)
        ra = eng.add_request(a, GREEDY)
        out_a = eng.run_to_completion([ra])[ra].outputs[0].token_ids
        turn = a + out_a + more
        rb, rt = eng.add_request(b, GREEDY), eng.add_request(turn, GREEDY)
        fin = eng.run_to_completion([rb, rt])
        got[hybrid] = [out_a, fin[rb].outputs[0].token_ids, fin[rt].outputs[0].token_ids]
        cached[hybrid] = [fin[rb].num_cached_tokens, fin[rt].num_cached_tokens]
    assert cached[False] == [40, 104] and cached[True] == [0, 104], cached
    assert got[True] == got[False] == _lone(small_model, [a, b, a + got[True][0] + more])


def test_many_requests_sharing_prefixes_match_lone_runs(small_model):
    # Shared prefixes of 24 and 50 tokens, then up to 70 more: some hits are
    # cut short where a long prompt overwrote the window, some copied
    # between rings, under preemption.
    rng = np.random.default_rng(7)
    heads = [list(map(int, rng.integers(0, 97, k))) for k in (24, 50)]
    prompts = [
        heads[i % 2] + list(map(int, rng.integers(0, 97, int(rng.integers(1, 70)))))
        for i in range(12)
    ]
    eng = small_engine(small_model, num_pages=40, max_num_seqs=4)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    fin = eng.run_to_completion()
    seats = eng.scheduler.seats
    assert eng.bm.prefix_hit_tokens > 0 and seats.pages_copied > 0 and seats.pages_in_place > 0
    assert eng.scheduler.num_preemptions > 0
    assert [fin[i].outputs[0].token_ids for i in ids] == _lone(small_model, prompts)
