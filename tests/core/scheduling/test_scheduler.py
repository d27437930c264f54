"""The scheduler alone (a real block manager, no model): budgets, order,
chunking, admission, preemption and multi-step decode decisions, against
counts worked out by hand."""

from jaxkv.core.sampling_params import SamplingParams
from jaxkv.core.scheduling.block_manager import BlockManager
from jaxkv.core.scheduling.scheduler import Scheduler
from jaxkv.core.sequence import Sequence, Status
from jaxkv.worker.stop import StopRule

PS = 4


def seq(rid, n_prompt, max_tokens=20, **params):
    p = SamplingParams(max_tokens=max_tokens, **params)
    s = Sequence(rid, None, list(range(1, n_prompt + 1)), p, seed=0)
    s.stop = StopRule.for_request(p, (), n_prompt, 1000)
    return s


def run(sched, out, sampled=7):
    """What the engine does after a step: record computed K/V, append a
    sampled token to every sequence whose chunk completes."""
    for sc in out.scheduled:
        s = sched.bm
        s.mark_computed(sc.seq.request_id, sc.seq.all_token_ids, sc.start + sc.num_rows)
        if sc.completes:
            sc.seq.append_token(sampled)


def rows(out):
    return [(sc.seq.request_id, sc.start, sc.num_rows) for sc in out.scheduled]


def test_budget_chunks_prompts_and_decodes_go_first():
    sched = Scheduler(BlockManager(64, PS), max_num_seqs=8, max_num_batched_tokens=10)
    a, b, c = seq("a", 6), seq("b", 9), seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    # a whole (6), b's first 4 tokens; c waits (budget spent).
    assert rows(out) == [("a", 0, 6), ("b", 0, 4)] and out.num_steps == 1
    assert [s.request_id for s in sched.waiting] == ["c"]
    run(sched, out)
    out = sched.schedule()
    # a decodes first (1), then b's next chunk (5: the rest), then c (3) fits 4 left.
    assert rows(out) == [("a", 6, 1), ("b", 4, 5), ("c", 0, 3)]
    assert [sc.completes for sc in out.scheduled] == [True, True, True]
    for sc in out.scheduled:
        assert len(sched.bm.block_table(sc.seq.request_id)) == -(-(sc.start + sc.num_rows) // PS)


def test_sequence_cap_and_first_come_first_served():
    sched = Scheduler(BlockManager(64, PS), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(seq(f"r{i}", 2))
    out = sched.schedule()
    assert [r for r, _, _ in rows(out)] == ["r0", "r1"]
    assert [s.request_id for s in sched.waiting] == ["r2", "r3"]
    assert all(s.status is Status.RUNNING for s in sched.running)


def test_out_of_pages_preempts_the_newest_and_requeues_it_first():
    # 7 usable pages of 4 tokens: a (12 tokens, 3 pages) and b (12) fill 6.
    sched = Scheduler(
        BlockManager(8, PS, enable_prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=64
    )
    a, b = seq("a", 12), seq("b", 12)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())  # both prefill; each holds 3 pages, 1 free
    out = sched.schedule()  # a's decode takes the last page; b's needs one more: b goes
    assert rows(out) == [("a", 12, 1)]
    assert out.preempted == [b] and b.status is Status.WAITING and b.num_preemptions == 1
    assert list(sched.waiting) == [b] and b.request_id not in sched.bm
    run(sched, out)
    sched.remove(a)  # a finishes: b is re-admitted and prefills prompt + output again
    out = sched.schedule()
    assert rows(out) == [("b", 0, 13)]


def test_multi_step_decode_only_when_nothing_else_can_run():
    sched = Scheduler(
        BlockManager(64, PS), max_num_seqs=2, max_num_batched_tokens=64, max_num_steps=8
    )
    a, b = seq("a", 5, max_tokens=6), seq("b", 5)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())
    out = sched.schedule()
    assert out.num_steps == 8 and rows(out) == [("a", 5, 1), ("b", 5, 1)]
    # Pages reserved ahead: a may still make 5 tokens (6 - 1), b 8 (the cap).
    assert sched.bm.num_reserved("a") == 5 + 5 and sched.bm.num_reserved("b") == 5 + 8
    # A waiting request that could be admitted means one step at a time.
    sched = Scheduler(
        BlockManager(64, PS), max_num_seqs=4, max_num_batched_tokens=64, max_num_steps=8
    )
    sched.add(seq("x", 3))
    run(sched, sched.schedule())
    sched.add(seq("y", 3))
    assert sched.schedule().num_steps == 1
    # So does a sequence with a penalty (the host applies it between tokens).
    sched = Scheduler(
        BlockManager(64, PS), max_num_seqs=4, max_num_batched_tokens=64, max_num_steps=8
    )
    sched.add(seq("p", 3, repetition_penalty=1.2))
    run(sched, sched.schedule())
    assert sched.schedule().num_steps == 1
