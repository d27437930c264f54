"""Paging efficiency benchmark: jaxkv's BlockManager against a contiguous
allocator, under one KV budget and one continuous-batching scheduler.

A host-only simulation (no model, no device): requests with long-tailed
prompt and output lengths arrive over time and go through jaxkv's own
Scheduler (decodes first, oldest first; when out of pages it preempts the
most recently admitted by recompute; then FCFS admission while memory
allows), with a token budget large enough that a prompt prefills in one
step. An admitted request's prefill and every later decode yield one token
per step; a finished request frees its memory. The allocator under it:

  (a) paged: jaxkv's BlockManager, pages grown lazily page by page;
  (b) contiguous: the same interface reserving max_len slots (prompt +
      max_tokens, where max_tokens fills the model's max length) per
      request up front.

Reported per allocator: the fraction of allocated KV slots that hold live
tokens (mean over steps), mean and peak concurrent sequences, completed
requests per step, preemptions. A second workload where every prompt starts
with the same long system prompt reports prefix-cache hit rate and pages
saved by sharing, with caching on and off. A third (C) replays workload A
through the paged allocator with the pages each KV format fits in one byte
budget (the bfloat16 pool of --num-pages pages, for --geometry's layers, KV
heads and head_dim, scales included): the concurrency each format buys.

    python scripts/bench/paging.py [--requests 3000] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from jaxkv.core.sampling_params import SamplingParams
from jaxkv.core.scheduling.block_manager import BlockManager
from jaxkv.core.scheduling.scheduler import Scheduler
from jaxkv.core.sequence import Sequence

GOAL_LIVE = 0.95  # fraction of allocated slots that hold live tokens (paged)
GOAL_CONCURRENCY = 2.5  # mean concurrent sequences, paged / contiguous


@dataclasses.dataclass
class Request:
    rid: int
    arrival: int  # step at which it may be admitted
    tokens: list[int]  # prompt, then the output tokens it will generate
    prompt_len: int
    output_len: int


class ContiguousBlockManager(BlockManager):
    """The baseline allocator behind the same interface: every admitted
    request reserves max_len slots (whole pages) in one piece, up front, and
    never shares them (no prefix caching)."""

    def __init__(self, num_pages: int, page_size: int, max_len: int):
        super().__init__(num_pages, page_size, enable_prefix_caching=False)
        self.max_len = max_len

    def allocate(self, seq_id, token_ids, num_reserved=None, **kw) -> int:
        cached = super().allocate(seq_id, token_ids, num_reserved=self.max_len, **kw)
        self._seqs[seq_id].num_reserved = (
            len(token_ids) if num_reserved is None else max(num_reserved, cached)
        )
        return cached

    def append_slots(self, seq_id, num_new_tokens):
        s = self._seq(seq_id)
        if s.num_reserved + num_new_tokens > self.max_len:
            raise ValueError(f"sequence {seq_id!r} grows past max_len {self.max_len}")
        s.num_reserved += num_new_tokens  # its pages are reserved already
        return []


def simulate(requests: list[Request], bm: BlockManager, max_num_seqs: int) -> dict:
    """Run jaxkv's Scheduler over `bm` to completion, every scheduled chunk
    "computed" at once and every completed one emitting the request's next
    output token; return metrics."""
    sched = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=1 << 30)
    arrivals = collections.deque(sorted(requests, key=lambda r: (r.arrival, r.rid)))
    by_id: dict[str, Request] = {}
    step = completed = prefill_tokens = peak_running = peak_saved = 0
    live_fraction_sum = running_sum = busy_steps = saved_sum = 0.0
    ps = bm.page_size
    while completed < len(requests):
        while arrivals and arrivals[0].arrival <= step:
            r = arrivals.popleft()
            by_id[str(r.rid)] = r
            sched.add(
                Sequence(
                    str(r.rid),
                    None,
                    r.tokens[: r.prompt_len],
                    SamplingParams(max_tokens=r.output_len),
                    seed=0,
                )
            )
        out = sched.schedule()
        running = sched.running
        if running:
            slots = [bm.num_reserved(s.request_id) for s in running]
            # Pages the block tables list beyond the pages held: sharing.
            saved = sum(len(bm.block_table(s.request_id)) for s in running) - bm.num_used_pages
            # Shared pages are full prefix pages: each extra holder counts
            # page_size slots twice.
            live = sum(slots) - saved * ps
            live_fraction_sum += live / (bm.num_used_pages * ps)
            running_sum += len(running)
            saved_sum += saved
            busy_steps += 1
            peak_running = max(peak_running, len(running))
            peak_saved = max(peak_saved, saved)
        for sc in out.scheduled:
            s, r = sc.seq, by_id[sc.seq.request_id]
            decode = sc.start == s.num_tokens - 1 and s.num_output_tokens
            prefill_tokens += 0 if decode else sc.num_rows
            bm.mark_computed(s.request_id, s.all_token_ids, sc.start + sc.num_rows)
            if sc.completes:
                s.append_token(int(r.tokens[s.num_tokens]))
                if s.num_output_tokens == r.output_len:
                    sched.remove(s)
                    completed += 1
        step += 1
    out = dict(
        steps=step,
        completed=completed,
        completed_per_step=completed / step,
        live_slot_fraction=live_fraction_sum / busy_steps,
        mean_running=running_sum / busy_steps,
        peak_running=peak_running,
        preemptions=sched.num_preemptions,
        prefill_tokens=prefill_tokens,
        mean_pages_saved=saved_sum / busy_steps,
        peak_pages_saved=peak_saved,
    )
    if bm.enable_prefix_caching:
        out.update(
            prefix_hit_rate=bm.prefix_hit_rate,
            prefix_hit_pages=bm.prefix_hit_pages,
            evictions=bm.num_evictions,
        )
    return out


def lognormal_lengths(rng, n: int, median: float, sigma: float, lo: int, hi) -> np.ndarray:
    """Rounded lognormal(ln median, sigma) lengths clipped to [lo, hi]."""
    x = np.rint(rng.lognormal(math.log(median), sigma, size=n)).astype(np.int64)
    return np.clip(x, lo, hi)


def make_workload(args, n: int, system_prompt: int, user_median: float, seed: int) -> list[Request]:
    """`n` requests: a shared `system_prompt`-token prefix (0 for none),
    lognormal user prompt and output lengths, Poisson arrivals."""
    rng = np.random.default_rng(seed)
    max_prompt = args.max_len - 1
    user = lognormal_lengths(rng, n, user_median, args.prompt_sigma, 1, max_prompt - system_prompt)
    prompt = user + system_prompt
    output = lognormal_lengths(
        rng, n, args.output_median, args.output_sigma, 1, args.max_len - prompt
    )
    gaps = rng.exponential(1.0 / args.arrival_rate, size=n)
    arrival = np.floor(np.cumsum(gaps)).astype(np.int64)
    system = rng.integers(0, args.vocab, size=system_prompt).tolist()
    reqs = []
    for i in range(n):
        own = rng.integers(0, args.vocab, size=int(user[i] + output[i])).tolist()
        reqs.append(Request(i, int(arrival[i]), system + own, int(prompt[i]), int(output[i])))
    return reqs


def fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if x < 10 else f"{x:,.1f}"
    return f"{x:,}"


def table(title: str, columns: dict[str, dict], keys: list[str]) -> str:
    names = list(columns)
    lines = [
        f"### {title}",
        "",
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for k in keys:
        lines.append(
            f"| {k} | "
            + " | ".join(fmt(columns[n].get(k, "")) if k in columns[n] else "-" for n in names)
            + " |"
        )
    return "\n".join(lines)


def formats_at_one_budget(args, reqs) -> dict:
    """Workload C: one byte budget, the pages each KV format fits, workload A."""
    from jaxkv.model import memory

    geom = tuple(int(x) for x in args.geometry.split(","))
    budget = memory.kv_cache_bytes(*geom, args.page_size, args.num_pages, "bfloat16")
    out = {}
    for f in args.formats.split(","):
        pages = memory.pages_for_budget(budget, *geom, args.page_size, f)
        r = simulate(reqs, BlockManager(pages, args.page_size), args.max_num_seqs)
        out[f] = {
            "pages": pages,
            "token_slots": (pages - 1) * args.page_size,
            "bytes_per_token": memory.bytes_per_token(geom, f),
            **r,
        }
    print()
    print(
        table(
            f"C: KV formats in one {budget / 2**20:.0f} MiB budget (geometry {args.geometry})",
            out,
            [
                "bytes_per_token",
                "pages",
                "token_slots",
                "mean_running",
                "peak_running",
                "completed_per_step",
                "preemptions",
            ],
        )
    )
    if "int8" in out and "int4" in out:
        print(
            f"\nint4 holds {out['int4']['token_slots'] / out['int8']['token_slots']:.2f}x "
            "int8's tokens (goal >= 1.9x)"
        )
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--num-pages",
        type=int,
        default=2049,
        help="KV budget in pages, trash page included (default 2049: 32,768 slots)",
    )
    p.add_argument("--max-len", type=int, default=2048, help="model max length (prompt + output)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--prompt-median", type=float, default=256)
    p.add_argument("--prompt-sigma", type=float, default=1.0)
    p.add_argument("--output-median", type=float, default=128)
    p.add_argument("--output-sigma", type=float, default=1.0)
    p.add_argument(
        "--arrival-rate", type=float, default=1.0, help="mean requests per step (Poisson)"
    )
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prefix-requests", type=int, default=1000)
    p.add_argument("--system-prompt", type=int, default=512, help="shared prefix tokens")
    p.add_argument(
        "--user-median", type=float, default=64, help="user-prompt median (prefix workload)"
    )
    p.add_argument(
        "--formats",
        default="bfloat16,int8,fp8,int4",
        help="KV formats for workload C (default: %(default)s)",
    )
    p.add_argument(
        "--geometry",
        default="30,3,64",
        help="layers,KV heads,head_dim for workload C's bytes (default: SmolLM2's)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)

    capacity = (args.num_pages - 1) * args.page_size
    print(f"# bench_memory (seed {args.seed})\n")
    print(
        f"KV budget: {args.num_pages - 1} usable pages x {args.page_size} = {capacity:,} slots; "
        f"max_len {args.max_len}; max_num_seqs {args.max_num_seqs}"
    )
    print(
        f"Workload A: {args.requests} requests; prompt ~ round(lognormal(ln {args.prompt_median:g}, "
        f"{args.prompt_sigma:g})) clipped to [1, {args.max_len - 1}]; output ~ "
        f"round(lognormal(ln {args.output_median:g}, {args.output_sigma:g})) clipped to "
        f"[1, max_len - prompt]; arrivals Poisson, {args.arrival_rate:g} per step"
    )
    print(
        f"Workload B: {args.prefix_requests} requests; a shared {args.system_prompt}-token system "
        f"prompt + user prompt ~ lognormal(ln {args.user_median:g}, {args.prompt_sigma:g}); "
        "outputs and arrivals as in A\n"
    )

    t0 = time.perf_counter()
    reqs = make_workload(args, args.requests, 0, args.prompt_median, args.seed)
    prompts = np.array([r.prompt_len for r in reqs])
    outputs = np.array([r.output_len for r in reqs])
    print(
        f"A sampled: prompt mean {prompts.mean():.0f}, p50 {np.median(prompts):.0f}, "
        f"p99 {np.percentile(prompts, 99):.0f}; output mean {outputs.mean():.0f}, "
        f"p50 {np.median(outputs):.0f}, p99 {np.percentile(outputs, 99):.0f}\n"
    )
    a = {
        "paged (jaxkv)": simulate(
            reqs, BlockManager(args.num_pages, args.page_size), args.max_num_seqs
        ),
        "contiguous": simulate(
            reqs,
            ContiguousBlockManager(args.num_pages, args.page_size, args.max_len),
            args.max_num_seqs,
        ),
    }
    keys_a = [
        "live_slot_fraction",
        "mean_running",
        "peak_running",
        "completed_per_step",
        "steps",
        "preemptions",
        "prefill_tokens",
        "prefix_hit_rate",
    ]
    print(table("A: paged vs contiguous", a, keys_a))
    pg, ct = a["paged (jaxkv)"], a["contiguous"]
    ratio = pg["mean_running"] / ct["mean_running"]
    ok_live = pg["live_slot_fraction"] >= GOAL_LIVE
    ok_conc = ratio >= GOAL_CONCURRENCY
    print(
        f"\nGoal: paged live slots >= {GOAL_LIVE:.0%}: {pg['live_slot_fraction']:.1%} "
        f"{'PASS' if ok_live else 'FAIL'}"
    )
    print(
        f"Goal: concurrency >= {GOAL_CONCURRENCY}x contiguous: {ratio:.2f}x mean "
        f"({pg['peak_running'] / ct['peak_running']:.2f}x peak) {'PASS' if ok_conc else 'FAIL'}; "
        f"completed/step {pg['completed_per_step'] / ct['completed_per_step']:.2f}x\n"
    )

    reqs_b = make_workload(
        args, args.prefix_requests, args.system_prompt, args.user_median, args.seed + 1
    )
    b = {
        "prefix caching on": simulate(
            reqs_b, BlockManager(args.num_pages, args.page_size), args.max_num_seqs
        ),
        "prefix caching off": simulate(
            reqs_b,
            BlockManager(args.num_pages, args.page_size, enable_prefix_caching=False),
            args.max_num_seqs,
        ),
    }
    keys_b = [
        "prefix_hit_rate",
        "prefix_hit_pages",
        "mean_pages_saved",
        "peak_pages_saved",
        "prefill_tokens",
        "mean_running",
        "peak_running",
        "completed_per_step",
        "live_slot_fraction",
        "preemptions",
    ]
    print(table(f"B: shared {args.system_prompt}-token system prompt (paged)", b, keys_b))
    on, off = b["prefix caching on"], b["prefix caching off"]
    print(
        f"\nPrefix caching: {on['prefix_hit_rate']:.1%} of prompt tokens served from cache, "
        f"{on['mean_pages_saved']:.0f} pages saved per step on average, prefill work "
        f"{on['prefill_tokens'] / off['prefill_tokens']:.1%} of uncached, "
        f"{on['mean_running'] / off['mean_running']:.2f}x concurrency"
    )
    c = formats_at_one_budget(args, reqs)
    elapsed = time.perf_counter() - t0
    print(f"\n({elapsed:.1f} s)")
    if args.json:
        args.json.write_text(
            json.dumps(
                dict(
                    args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    workload_a=a,
                    workload_b=b,
                    workload_c=c,
                    concurrency_ratio=ratio,
                    goals=dict(live_slot_fraction=ok_live, concurrency=ok_conc),
                    seconds=elapsed,
                ),
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
