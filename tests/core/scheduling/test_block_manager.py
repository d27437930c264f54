"""BlockManager: unit tests for each behaviour, then a hypothesis state machine
that drives random allocate / grow / write / fork / free sequences against a
model of the device pages and checks the pool invariants after every rule."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxkv.core.scheduling.block_manager import (
    TRASH_PAGE,
    BlockManager,
    OutOfPages,
    UnknownSequenceError,
    hash_page,
)

PS = 4


def run_prompt(bm: BlockManager, seq_id, tokens) -> int:
    """Allocate a prompt and mark it computed, as the scheduler does after the
    prefill step; return the cached token count."""
    cached = bm.allocate(seq_id, tokens)
    bm.mark_computed(seq_id, tokens, len(tokens))
    return cached


# ------------------------------------------------------------------ unit tests


def test_rejects_bad_geometry():
    with pytest.raises(ValueError, match="num_pages"):
        BlockManager(1, PS)
    with pytest.raises(ValueError, match="page_size"):
        BlockManager(8, 0)


def test_page_zero_never_handed_out_and_pool_exhausts():
    bm = BlockManager(num_pages=5, page_size=PS)
    assert bm.num_free_pages == 4
    bm.allocate("a", list(range(4 * PS)))
    assert sorted(bm.block_table("a")) == [1, 2, 3, 4]
    assert TRASH_PAGE not in bm.block_table("a")
    assert bm.num_free_pages == 0
    assert not bm.can_allocate(1)
    with pytest.raises(OutOfPages):
        bm.allocate("b", [1])
    assert "b" not in bm


def test_free_returns_pages():
    bm = BlockManager(num_pages=9, page_size=PS, enable_prefix_caching=False)
    bm.allocate("a", list(range(10)))  # 3 pages
    bm.allocate("b", list(range(5)))  # 2 pages
    assert bm.num_free_pages == 3 and bm.num_used_pages == 5
    bm.free("a")
    assert bm.num_free_pages == 6
    bm.free("b")
    assert bm.num_free_pages == 8
    assert sorted(bm.free_pages()) == list(range(1, 9))
    assert all(bm.refcount(p) == 0 for p in range(9))


def test_double_free_and_unknown_ids_raise():
    bm = BlockManager(num_pages=8, page_size=PS)
    bm.allocate("a", [1, 2, 3])
    bm.free("a")
    with pytest.raises(UnknownSequenceError, match="double free"):
        bm.free("a")
    with pytest.raises(UnknownSequenceError):
        bm.block_table("nope")
    with pytest.raises(UnknownSequenceError):
        bm.append_slots("nope", 1)
    bm.allocate("b", [1])
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate("b", [1])
    with pytest.raises(ValueError):
        bm.allocate("c", [])


def test_lazy_growth_page_by_page():
    bm = BlockManager(num_pages=8, page_size=PS)
    bm.allocate("a", [7] * 3)
    assert len(bm.block_table("a")) == 1
    assert bm.append_slots("a", 1) == []  # position 3 fills page 0
    assert len(bm.block_table("a")) == 1
    bm.append_slots("a", 1)  # position 4 opens page 1
    assert len(bm.block_table("a")) == 2 and bm.num_reserved("a") == 5
    bm.append_slots("a", 6)  # up to position 10: three pages
    assert len(bm.block_table("a")) == 3 and bm.num_reserved("a") == 11
    assert len(set(bm.block_table("a"))) == 3


def test_out_of_pages_leaves_state_unchanged():
    bm = BlockManager(num_pages=4, page_size=PS)
    bm.allocate("a", [1] * (2 * PS))
    bm.allocate("b", [2] * PS)
    assert not bm.can_append_slots("a", 1)
    before = (bm.block_table("a"), bm.num_reserved("a"), bm.num_free_pages)
    with pytest.raises(OutOfPages):
        bm.append_slots("a", 1)
    assert (bm.block_table("a"), bm.num_reserved("a"), bm.num_free_pages) == before


def test_prefix_hit_reuses_pages_and_reports_cached_tokens():
    bm = BlockManager(num_pages=16, page_size=PS)
    system = list(range(100, 100 + 3 * PS))  # three full pages
    a = system + [1, 2]
    assert run_prompt(bm, "a", a) == 0
    assert bm.num_cached_pages == 3  # the partial 4th page is not cached
    b = system + [9, 9, 9]
    free_before = bm.num_free_pages
    assert bm.can_allocate(len(b), b)
    assert bm.allocate("b", b) == 3 * PS
    assert bm.block_table("b")[:3] == bm.block_table("a")[:3]
    assert bm.block_table("b")[3] != bm.block_table("a")[3]
    assert all(bm.refcount(p) == 2 for p in bm.block_table("a")[:3])
    assert bm.num_free_pages == free_before - 1  # only the tail page is new
    assert (bm.prefix_hit_pages, bm.prefix_hit_tokens) == (3, 3 * PS)
    assert bm.prefix_hit_rate == pytest.approx(3 * PS / (len(a) + len(b)))


def test_cache_salt_roots_separate_the_hash_chains():
    from jaxkv.core.scheduling.page_pool import ROOT_HASH, salted_root

    bm = BlockManager(num_pages=32, page_size=PS)
    prompt = list(range(100, 100 + 3 * PS)) + [1]
    a, b = salted_root("tenant-a"), salted_root("tenant-b")
    assert len({ROOT_HASH, a, b}) == 3 and salted_root("tenant-a") == a
    cached = bm.allocate("a1", prompt, root=a)
    bm.mark_computed("a1", prompt, len(prompt))
    assert cached == 0
    assert bm.allocate("b1", prompt, root=b) == 0  # another tenant: no hit
    assert bm.allocate("plain", prompt) == 0  # no salt: no hit on salted pages either
    assert bm.allocate("a2", prompt, root=a) == 3 * PS  # same tenant: hit
    # The chain starts from the salt: page 0's hash is hash_page(root, tokens).
    assert bm.page_hash(bm.block_table("a1")[0]) == hash_page(a, prompt[:PS])


def test_prefix_hit_never_covers_the_last_token():
    bm = BlockManager(num_pages=16, page_size=PS)
    prompt = list(range(2 * PS))
    run_prompt(bm, "a", prompt)
    assert bm.num_cached_pages == 2
    # The identical prompt: its last token must be recomputed for logits, so
    # only the first page is reused.
    assert bm.allocate("b", prompt) == PS
    assert bm.allocate("c", prompt + [5]) == 2 * PS


def test_pages_cached_only_after_mark_computed():
    bm = BlockManager(num_pages=16, page_size=PS)
    prompt = list(range(2 * PS + 1))
    bm.allocate("a", prompt)
    assert bm.allocate("b", prompt) == 0  # "a" has not written its K/V yet
    bm.mark_computed("a", prompt, PS)  # first chunk written
    assert bm.num_cached_pages == 1
    assert bm.allocate("c", prompt) == PS


def test_generated_tokens_become_cacheable():
    bm = BlockManager(num_pages=16, page_size=PS)
    tokens = list(range(PS - 1))
    run_prompt(bm, "a", tokens)
    tokens.append(42)  # sampled
    bm.append_slots("a", 1)
    bm.mark_computed("a", tokens, len(tokens))
    assert bm.num_cached_pages == 1
    assert bm.allocate("b", tokens + [1]) == PS


def test_freed_cached_pages_are_reused_on_hit():
    bm = BlockManager(num_pages=8, page_size=PS)
    prompt = list(range(2 * PS + 1))
    run_prompt(bm, "a", prompt)
    cached_pages = bm.block_table("a")[:2]
    bm.free("a")
    assert bm.num_evictable_pages == 2 and bm.num_free_pages == 7
    assert bm.allocate("b", prompt) == 2 * PS
    assert bm.block_table("b")[:2] == cached_pages
    assert bm.num_evictable_pages == 0


def test_mark_computed_rejects_bad_counts():
    bm = BlockManager(num_pages=8, page_size=PS)
    prompt = list(range(PS + 1))
    run_prompt(bm, "a", prompt)
    assert bm.allocate("b", prompt) == PS
    with pytest.raises(ValueError, match="outside"):
        bm.mark_computed("b", prompt, PS + 2)  # past the reserved slots
    with pytest.raises(ValueError, match="outside"):
        bm.mark_computed("b", prompt, PS - 1)  # below the cached tokens
    with pytest.raises(ValueError, match="token ids"):
        bm.mark_computed("b", prompt[:PS], PS + 1)


def test_duplicate_prefix_stays_private():
    bm = BlockManager(num_pages=8, page_size=PS)
    prompt = list(range(PS + 1))
    bm.allocate("a", prompt)
    bm.allocate("b", prompt)  # both miss: neither is computed yet
    bm.mark_computed("a", prompt, len(prompt))
    bm.mark_computed("b", prompt, len(prompt))
    assert bm.num_cached_pages == 1
    assert bm.page_hash(bm.block_table("a")[0]) is not None
    assert bm.page_hash(bm.block_table("b")[0]) is None
    bm.free("b")
    assert bm.num_evictable_pages == 0  # b's duplicate page went back to free


def test_lru_eviction_order():
    bm = BlockManager(num_pages=7, page_size=PS)
    # Three one-page prefixes (plus a partial page each), released in order x, y, z.
    prompts = {name: [k] * PS + [0] for k, name in enumerate("xyz", 1)}
    for name, prompt in prompts.items():
        run_prompt(bm, name, prompt)
    cached = {name: bm.block_table(name)[0] for name in prompts}
    for name in "xyz":
        bm.free(name)
    assert bm.evictable_pages() == [cached["x"], cached["y"], cached["z"]]
    # Hit on y: it leaves the evictable set; freed again, it is most recent.
    assert bm.allocate("y2", prompts["y"]) == PS
    bm.free("y2")
    assert bm.evictable_pages() == [cached["x"], cached["z"], cached["y"]]
    # Take all 3 clean free pages, then two more: evicts x, then z.
    bm.allocate("big", list(range(1000, 1000 + 5 * PS)))
    assert bm.num_evictions == 2
    assert bm.evictable_pages() == [cached["y"]]
    bm.free("big")
    assert bm.allocate("x2", prompts["x"]) == 0
    assert bm.allocate("y3", prompts["y"]) == PS


def test_free_releases_tail_pages_first():
    bm = BlockManager(num_pages=8, page_size=PS)
    prompt = list(range(3 * PS + 1))
    run_prompt(bm, "a", prompt)
    table = bm.block_table("a")
    bm.free("a")
    # The deepest page is evicted first: it is useless without its prefix.
    assert bm.evictable_pages() == [table[2], table[1], table[0]]


def test_fork_shares_pages_and_copy_on_write():
    bm = BlockManager(num_pages=8, page_size=PS)
    prompt = list(range(PS + 2))  # one full page + a half page
    run_prompt(bm, "p", prompt)
    bm.fork("p", "c")
    table = bm.block_table("p")
    assert bm.block_table("c") == table
    assert all(bm.refcount(p) == 2 for p in table)
    # The child writes position PS+2 into the shared half page: it gets a copy.
    copies = bm.append_slots("c", 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == table[1] and dst not in table and dst != TRASH_PAGE
    assert bm.block_table("c") == [table[0], dst]
    assert bm.refcount(src) == 1 and bm.refcount(dst) == 1 and bm.refcount(table[0]) == 2
    # The parent is now the only holder of its half page: no copy needed.
    assert bm.append_slots("p", 1) == []
    assert bm.block_table("p") == table


def test_fork_at_page_boundary_needs_no_copy():
    bm = BlockManager(num_pages=8, page_size=PS)
    run_prompt(bm, "p", list(range(PS)))
    bm.fork("p", "c")
    assert bm.append_slots("c", 1) == []
    assert bm.block_table("c")[0] == bm.block_table("p")[0]


def test_fork_requires_written_slots():
    bm = BlockManager(num_pages=8, page_size=PS)
    bm.allocate("p", [1, 2, 3])
    with pytest.raises(ValueError, match="mark_computed"):
        bm.fork("p", "c")
    bm.mark_computed("p", [1, 2, 3], 3)
    bm.fork("p", "c")
    with pytest.raises(ValueError, match="already allocated"):
        bm.fork("p", "c")


def test_cow_out_of_pages_raises():
    bm = BlockManager(num_pages=3, page_size=PS)
    run_prompt(bm, "p", [1, 2])
    bm.fork("p", "c")
    bm.allocate("x", [3])  # takes the last free page
    assert not bm.can_append_slots("c", 1)
    with pytest.raises(OutOfPages):
        bm.append_slots("c", 1)


def test_caching_disabled_never_hits():
    bm = BlockManager(num_pages=8, page_size=PS, enable_prefix_caching=False)
    prompt = list(range(2 * PS + 1))
    run_prompt(bm, "a", prompt)
    assert bm.num_cached_pages == 0
    assert bm.allocate("b", prompt) == 0
    bm.free("a")
    assert bm.num_evictable_pages == 0


def test_hash_page_is_chained():
    a = hash_page(b"", [1, 2])
    assert a == hash_page(b"", [1, 2])
    assert a != hash_page(b"", [2, 1])
    assert hash_page(a, [3, 4]) != hash_page(hash_page(b"", [0, 2]), [3, 4])


# ------------------------------------------------------------ state machine

POOL = 16  # pages 1..15
SPS = 2  # small pages: many boundaries, many hits
TOKENS = st.integers(0, 2)  # tiny alphabet so prefixes collide often


class _Seq:
    """The test's own view of one sequence: its tokens, reserved slots, and
    how many slots have K/V written."""

    def __init__(self, tokens, slots, computed):
        self.tokens = list(tokens)
        self.slots = slots
        self.computed = computed


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(POOL, SPS)
        self.seqs: dict[int, _Seq] = {}
        self.next_id = 0
        # Device model: what token each page slot holds, and, per page, the
        # writer's full token prefix through that page (for expected hashes).
        self.content: dict[int, list] = {p: [None] * SPS for p in range(POOL)}
        self.prefix: dict[int, tuple] = {}
        self.history: list[list[int]] = [[0, 1, 2, 0, 1, 2]]

    # --- helpers

    def _fresh_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _apply_copies(self, copies):
        for src, dst in copies:
            assert src != dst and dst != TRASH_PAGE
            self.content[dst] = list(self.content[src])
            self.prefix[dst] = self.prefix.get(src, ())

    def _expect_lru(self, evictable_before, hits):
        """Pages that left the evictable set other than prefix hits must be
        its least recently released ones."""
        after = set(self.bm.evictable_pages())
        gone = [p for p in evictable_before if p not in after and p not in hits]
        assert gone == [p for p in evictable_before if p not in hits][: len(gone)]

    # --- rules

    @rule(base=st.integers(0, 100), keep=st.integers(0, 6), extra=st.lists(TOKENS, max_size=3))
    def allocate(self, base, keep, extra):
        """A new prompt, often a prefix of an earlier sequence's tokens."""
        prompt = self.history[base % len(self.history)][:keep] + extra
        if not prompt:
            prompt = [0]
        sid = self._fresh_id()
        can = self.bm.can_allocate(len(prompt), prompt)
        evictable_before = self.bm.evictable_pages()
        try:
            cached = self.bm.allocate(sid, prompt)
        except OutOfPages:
            assert not can
            assert sid not in self.bm and self.bm.evictable_pages() == evictable_before
            return
        assert can
        assert cached % SPS == 0 and 0 <= cached < len(prompt)
        table = self.bm.block_table(sid)
        assert len(table) == -(-len(prompt) // SPS)
        # A prefix hit must serve exactly the prompt's K/V.
        for pos in range(cached):
            assert self.content[table[pos // SPS]][pos % SPS] == prompt[pos]
        self._expect_lru(evictable_before, set(table[: cached // SPS]))
        self.seqs[sid] = _Seq(prompt, len(prompt), cached)
        self.history.append(prompt)

    def _write(self, sid):
        """A step: write K/V for the reserved slots, then mark them computed."""
        s = self.seqs[sid]
        table = self.bm.block_table(sid)
        for pos in range(s.computed, s.slots):
            page = table[pos // SPS]
            assert page != TRASH_PAGE
            assert self.bm.refcount(page) == 1, "two writers on one page"
            self.content[page][pos % SPS] = s.tokens[pos]
            self.prefix[page] = tuple(s.tokens[: (pos // SPS + 1) * SPS])
        self.bm.mark_computed(sid, s.tokens, s.slots)
        s.computed = s.slots
        self.history.append(list(s.tokens))

    def _grow(self, sid, n) -> bool:
        """Reserve slots for ``n`` more known tokens; False when out of pages."""
        s = self.seqs[sid]
        can = self.bm.can_append_slots(sid, n)
        before = self.bm.block_table(sid)
        evictable_before = self.bm.evictable_pages()
        try:
            copies = self.bm.append_slots(sid, n)
        except OutOfPages:
            assert not can
            assert self.bm.block_table(sid) == before
            assert self.bm.evictable_pages() == evictable_before
            return False
        assert can
        self._expect_lru(evictable_before, set())
        after = self.bm.block_table(sid)
        assert len(after) == -(-(s.slots + n) // SPS)
        if copies:
            assert len(copies) == 1 and s.slots % SPS
            ((src, dst),) = copies
            idx = s.slots // SPS
            assert before[idx] == src and after[idx] == dst and self.bm.refcount(src) >= 1
        else:
            assert after[: len(before)] == before
        self._apply_copies(copies)
        s.slots += n
        return True

    def _ready(self):
        """Sequences whose every known token is computed (may sample)."""
        return sorted(i for i, s in self.seqs.items() if s.computed == len(s.tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def write(self, data):
        self._write(data.draw(st.sampled_from(sorted(self.seqs))))

    @precondition(lambda self: self._ready())
    @rule(data=st.data(), new=st.lists(TOKENS, min_size=1, max_size=3))
    def sample(self, data, new):
        """Sampling appends tokens once every known token is computed."""
        self.seqs[data.draw(st.sampled_from(self._ready()))].tokens.extend(new)

    @precondition(lambda self: any(s.slots < len(s.tokens) for s in self.seqs.values()))
    @rule(data=st.data())
    def grow(self, data):
        """Reserve slots for some not yet reserved tokens (a prefill chunk)."""
        growable = sorted(i for i, s in self.seqs.items() if s.slots < len(s.tokens))
        sid = data.draw(st.sampled_from(growable))
        s = self.seqs[sid]
        self._grow(sid, data.draw(st.integers(1, len(s.tokens) - s.slots)))

    @precondition(lambda self: self._ready())
    @rule(data=st.data(), token=TOKENS)
    def decode(self, data, token):
        """One whole decode step: sample a token, reserve its slot, write it."""
        sid = data.draw(st.sampled_from(self._ready()))
        self.seqs[sid].tokens.append(token)
        if self._grow(sid, 1):
            self._write(sid)

    @precondition(lambda self: any(s.computed == s.slots for s in self.seqs.values()))
    @rule(data=st.data())
    def fork(self, data):
        forkable = sorted(i for i, s in self.seqs.items() if s.computed == s.slots)
        parent = self.seqs[data.draw(st.sampled_from(forkable))]
        pid = next(i for i, s in self.seqs.items() if s is parent)
        cid = self._fresh_id()
        self.bm.fork(pid, cid)
        assert self.bm.block_table(cid) == self.bm.block_table(pid)
        self.seqs[cid] = _Seq(parent.tokens[: parent.slots], parent.slots, parent.computed)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.bm.free(sid)
        del self.seqs[sid]
        with pytest.raises(UnknownSequenceError):
            self.bm.free(sid)

    @precondition(lambda self: self.seqs)
    @rule()
    def preempt(self):
        """The scheduler's preemption: free the newest sequence; its tokens
        join the history, so a later allocate may re-admit them (recompute)
        from its cached pages."""
        sid = max(self.seqs)
        tokens = self.seqs.pop(sid).tokens
        self.bm.free(sid)
        self.history.append(tokens)

    # --- invariants

    @invariant()
    def pages_accounted_for(self):
        free = self.bm.free_pages()
        evictable = self.bm.evictable_pages()
        held: dict[int, int] = {}
        for sid in self.seqs:
            table = self.bm.block_table(sid)
            assert len(table) == len(set(table))
            for p in table:
                held[p] = held.get(p, 0) + 1
        assert len(free) == len(set(free)) and len(evictable) == len(set(evictable))
        assert TRASH_PAGE not in held and TRASH_PAGE not in free and TRASH_PAGE not in evictable
        assert not set(free) & set(evictable) and not (set(free) | set(evictable)) & held.keys()
        assert set(free) | set(evictable) | held.keys() == set(range(1, POOL))
        for p in range(POOL):
            assert self.bm.refcount(p) == held.get(p, 0)
        assert self.bm.num_free_pages == len(free) + len(evictable)

    @invariant()
    def sequences_match_model(self):
        for sid, s in self.seqs.items():
            assert self.bm.num_reserved(sid) == s.slots
            assert self.bm.num_computed_tokens(sid) == s.computed
            table = self.bm.block_table(sid)
            assert len(table) == -(-s.slots // SPS)
            for pos in range(s.computed):
                assert self.content[table[pos // SPS]][pos % SPS] == s.tokens[pos]

    @invariant()
    def cached_hashes_match_written_tokens(self):
        evictable = set(self.bm.evictable_pages())
        for p in range(1, POOL):
            h = self.bm.page_hash(p)
            if h is None:
                assert p not in evictable
                continue
            prefix = self.prefix[p]
            assert len(prefix) % SPS == 0 and prefix
            assert self.content[p] == list(prefix[-SPS:])
            expect = b""
            for i in range(0, len(prefix), SPS):
                expect = hash_page(expect, prefix[i : i + SPS])
            assert h == expect


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
