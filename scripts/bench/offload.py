"""KV offload tiers on a multi-turn chat replay: time to first token of the
later turns and throughput with the tiers off, a host tier, host + disk,
and after a restart on the disk tier.

    python scripts/bench/offload.py [--conversations 48] [--turns 6] [--runs 2]

Each conversation is a system prompt then `--turns` turns of a user message
(`--user` tokens of text) and a greedy answer of `--answer` tokens on average
(each turn's length drawn from answer/2..3 answer/2, seeded, so the
conversations drift apart as chats do rather than finishing in lockstep); turn k's
prompt is the whole history so far, so by the last turn it is about
system + turns x (user + answer) tokens (up to ~1.4k with the defaults). The
conversations' turns are replayed round robin (every conversation's turn 1,
then every turn 2, ...), `--concurrency` requests at a time, through a
device pool sized to hold `--pool-fraction` of the final histories: by the
time a conversation comes back its pages have left the device.

- off: the device prefix cache alone (a later turn recomputes what left it);
- host: a host tier that holds every history (`kv_offload_memory`);
- host+disk: a host tier of the device pool's size over a disk tier;
- restart: host+disk for the first half of the turns, then the engine is
  shut down (the disk tier persisted) and a new one on the same directory
  replays the rest; its TTFT of the turns after the restart is reported.

TTFT is measured from `add_request` to the step that returns the request's
first token. Figures are medians over `--runs` runs (variants interleaved);
ratios are TTFT p50 of turns >= 2 against "off". Writes
scripts/results/bench_offload_cpu_<date>.json.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

ROOT = Path(__file__).resolve().parents[2]

VARIANTS = ("off", "host", "host+disk", "restart")


def conversations(
    tokenizer, vocab: int, n: int, turns: int, system: int, user: int
) -> tuple[list[int], list[list[list[int]]]]:
    """(system prompt, per conversation its users' messages) as token ids:
    distinct slices of the built-in text (or pseudo-random ids)."""
    from scripts.bench.common import prompt_stream

    stream = prompt_stream(tokenizer, vocab, 4096)
    rng = np.random.default_rng(7)
    msgs = []
    for _ in range(n):
        conv = []
        for _ in range(turns):
            off = int(rng.integers(0, len(stream) - user))
            conv.append(stream[off : off + user])
        msgs.append(conv)
    return stream[:system], msgs


def make_engine(args, variant: str, disk_dir: str | None, pool_pages: int, host_bytes: int):
    from jaxkv.core.engine import LLMEngine

    kw = dict(
        num_pages=pool_pages,
        page_size=args.page_size,
        max_num_seqs=args.concurrency,
        max_num_batched_tokens=args.batched_tokens,
        max_model_len=args.max_model_len,
        num_decode_steps=args.decode_steps,
    )
    if variant == "host":
        kw.update(kv_offload_memory=host_bytes)
    elif variant in ("host+disk", "restart"):
        kw.update(
            kv_offload_memory=max(1, pool_pages * args.page_bytes),
            kv_offload_dir=disk_dir,
            kv_offload_disk="16GiB",
        )
    return LLMEngine.from_pretrained(args.model, **kw)


def replay(eng, system, msgs, turns: range, history: dict, args) -> list[tuple[int, float]]:
    """Run `turns` of every conversation round robin, `args.concurrency` at a
    time; returns (turn, ttft seconds) of each request. `history[c]`: the
    conversation's tokens so far (extended with each turn and answer)."""
    from jaxkv.core.sampling_params import SamplingParams

    queue = collections.deque((c, turns.start) for c in range(len(msgs)))
    live: dict[str, tuple[int, int, float]] = {}  # rid -> (conversation, turn, t_added)
    first: dict[str, float] = {}
    ttft = []
    while queue or live:
        while queue and len(live) < args.concurrency:
            c, k = queue.popleft()
            history[c] = history.get(c, list(system)) + msgs[c][k]
            params = SamplingParams(
                max_tokens=int(args.answer_lengths[c, k]), temperature=0, ignore_eos=True
            )
            rid = eng.add_request(list(history[c]), params)
            live[rid] = (c, k, time.perf_counter())
        for out in eng.step():
            rid = out.request_id
            if rid not in first and out.outputs[0].token_ids:
                first[rid] = time.perf_counter()
            if out.finished:
                c, k, t0 = live.pop(rid)
                ttft.append((k, first[rid] - t0, len(out.outputs[0].token_ids)))
                history[c] = history[c] + list(out.outputs[0].token_ids)
                if k + 1 < turns.stop:
                    queue.append((c, k + 1))
    return ttft


def run_variant(args, variant: str, system, msgs, pool_pages: int, host_bytes: int) -> dict:
    disk_dir = tempfile.mkdtemp(prefix="jaxkv-offload-")
    try:
        history: dict = {}
        eng = make_engine(args, variant, disk_dir, pool_pages, host_bytes)
        split = args.turns // 2 if variant == "restart" else args.turns
        t0 = time.perf_counter()
        ttft = replay(eng, system, msgs, range(0, split), history, args)
        stats = [dict(eng.stats), eng.kv_metrics()]
        if variant == "restart":
            eng.shutdown()  # the disk tier persisted
            t_busy = time.perf_counter() - t0
            eng = make_engine(args, variant, disk_dir, pool_pages, host_bytes)
            t0 = time.perf_counter()
            after = replay(eng, system, msgs, range(split, args.turns), history, args)
            t_busy += time.perf_counter() - t0
            ttft += after
            stats += [dict(eng.stats), eng.kv_metrics()]
        else:
            t_busy = time.perf_counter() - t0
        eng.shutdown()
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    generated = sum(n for _, _, n in ttft)
    later = [t for k, t, _ in ttft if k >= 1]
    res = dict(
        ttft_p50_later=float(np.percentile(later, 50)),
        ttft_p90_later=float(np.percentile(later, 90)),
        ttft_p50_turn1=float(np.percentile([t for k, t, _ in ttft if k == 0], 50)),
        generated_tok_s=generated / t_busy,
        seconds=t_busy,
        prompt_tokens_computed=sum(s.get("prompt_tokens_computed", 0) for s in stats[0::2]),
        tiers=stats[1::2],
    )
    if variant == "restart":
        res["ttft_p50_after_restart"] = float(
            np.percentile([t for k, t, _ in ttft if k >= args.turns // 2], 50)
        )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--user", type=int, default=100)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--batched-tokens", type=int, default=512)
    ap.add_argument("--pool-fraction", type=float, default=0.2)
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=1,
        help="the engine's num_decode_steps (1: a turn's TTFT never waits on a "
        "multi-step decode call already in flight)",
    )
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from jaxkv.core.engine import LLMEngine
    from jaxkv.model.kv_cache import paged_leaves
    from scripts.bench.common import _cpu_name, _loadavg, _num_cores

    probe = LLMEngine.from_pretrained(
        args.model, num_pages=4, page_size=args.page_size, warmup=False
    )
    tokenizer, vocab = probe.tokenizer, probe.model_config.vocab_size
    args.page_bytes = sum(x.nbytes // x.shape[1] for x in paged_leaves(probe.runner.cache))
    del probe
    system, msgs = conversations(
        tokenizer, vocab, args.conversations, args.turns, args.system, args.user
    )
    args.answer_lengths = np.random.default_rng(11).integers(
        args.answer // 2, args.answer * 3 // 2 + 1, (args.conversations, args.turns)
    )
    final = args.system + args.turns * args.user + int(args.answer_lengths.sum(1).max())
    args.max_model_len = final + args.page_size
    pool_pages = (
        max(
            int(args.pool_fraction * args.conversations * final / args.page_size),
            args.concurrency * -(-final // args.page_size),
        )
        + 1
    )
    host_bytes = int(1.25 * args.conversations * final / args.page_size) * args.page_bytes
    variants = args.variants.split(",")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.runs):
        for v in variants:
            res = run_variant(args, v, system, msgs, pool_pages, host_bytes)
            runs[v].append(res)
            print(
                f"run {r} {v:10s} ttft p50 {res['ttft_p50_later'] * 1e3:8.1f} ms  p90 "
                f"{res['ttft_p90_later'] * 1e3:8.1f} ms  {res['generated_tok_s']:6.1f} tok/s  "
                f"computed {res['prompt_tokens_computed']}",
                flush=True,
            )

    def med(v, key):
        xs = [r[key] for r in runs[v] if key in r]
        return float(statistics.median(xs)) if xs else None

    table = {}
    for v in variants:
        table[v] = {
            k: med(v, k)
            for k in (
                "ttft_p50_later",
                "ttft_p90_later",
                "ttft_p50_turn1",
                "generated_tok_s",
                "prompt_tokens_computed",
                "ttft_p50_after_restart",
            )
        }
        if "off" in table:
            table[v]["ttft_p50_speedup_vs_off"] = (
                table["off"]["ttft_p50_later"] / table[v]["ttft_p50_later"]
            )
    print(f"\n{'variant':10s} {'TTFT p50':>10s} {'TTFT p90':>10s} {'x off':>7s} {'tok/s':>7s}")
    for v, t in table.items():
        print(
            f"{v:10s} {t['ttft_p50_later'] * 1e3:8.1f}ms {t['ttft_p90_later'] * 1e3:8.1f}ms "
            f"{t.get('ttft_p50_speedup_vs_off', float('nan')):6.2f}x "
            f"{t['generated_tok_s']:7.1f}"
        )
    out = (
        Path(args.out)
        if args.out
        else (
            ROOT
            / "scripts"
            / "results"
            / f"bench_offload_cpu_{datetime.date.today().isoformat()}.json"
        )
    )
    out.write_text(
        json.dumps(
            dict(
                command=" ".join(sys.argv),
                cpu=_cpu_name(),
                cores=_num_cores(),
                loadavg=_loadavg(),
                args={
                    k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in vars(args).items()
                },
                pool_pages=pool_pages,
                host_bytes=host_bytes,
                final_history_tokens=final,
                table=table,
                runs=runs,
            ),
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
