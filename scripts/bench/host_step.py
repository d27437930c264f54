"""Host time per engine step while decoding, on a random tiny model.

    python scripts/bench/host_step.py [--batch 64 256] [--lengths 128 4096] [--window 32]
        [--runs 1] [--json out.json]

The device part of a step is kept small (a 2-layer random model, width 64,
one KV head) so what is measured is the host's: planning, packing,
dispatching, reading and post-processing a step (detokenizing, stop
rules, outputs). Host ms per step = `engine.step()` wall time minus the
time the host sat blocked reading the step's outputs
(`engine.runner.stats["wait_seconds"]`).

For each batch size, `batch` requests of 8 prompt tokens decode with
`ignore_eos` to the longest of `--lengths`, one token per step
(`num_decode_steps=1`, the host's worst case), sampled at temperature 1
so the output bytes are varied (the SmolLM2 tokenizer detokenizes them,
byte-level BPE, incomplete UTF-8 included). The figure at output length
L is the median host ms over the `--window` steps before the outputs
reach L tokens. Flat host work means the figure at 4096 equals the one at
128.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.common import _cpu_name, _loadavg, _num_cores

PROMPT_TOKENS = 8


def tiny_engine(tokenizer, batch: int, length: int):
    from jaxkv import LLMEngine
    from jaxkv.config import EngineConfig, ModelConfig
    from jaxkv.model.llama import Llama

    V = tokenizer.vocab_size
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=length + 64,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
    )
    model = Llama.random_init(cfg, seed=0)
    pages = batch * (-(-(length + PROMPT_TOKENS + 16) // 16)) + 16
    return LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            num_pages=pages,
            page_size=16,
            max_num_seqs=batch,
            max_num_batched_tokens=max(512, batch),
            num_decode_steps=1,
            max_model_len=length + PROMPT_TOKENS + 16,
            async_scheduling=False,
            warmup=True,
        ),
    )


def run(tokenizer, batch: int, lengths: list[int], window: int) -> dict:
    from jaxkv import SamplingParams

    longest = max(lengths)
    eng = tiny_engine(tokenizer, batch, longest)
    V = tokenizer.vocab_size
    for i in range(batch):
        prompt = [(7919 * i + 31 * j) % (V - 1) + 1 for j in range(PROMPT_TOKENS)]
        eng.add_request(
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=longest, ignore_eos=True, temperature=1.0, seed=i),
        )
    host_ms: dict[int, float] = {}  # output length before the step -> host ms
    generated = 0
    t_start = time.perf_counter()
    while eng.has_unfinished_requests():
        wait0 = eng.runner.stats["wait_seconds"]
        t0 = time.perf_counter()
        outs = eng.step()
        wall = time.perf_counter() - t0
        host = wall - (eng.runner.stats["wait_seconds"] - wait0)
        new = sum(len(c.delta_token_ids) for o in outs for c in o.outputs)
        if new == batch:  # every sequence decoded one token: a decode step
            host_ms[generated // batch] = host * 1e3
        generated += new
    wall = time.perf_counter() - t_start
    figures = {}
    for L in lengths:
        xs = [host_ms[n] for n in range(max(1, L - window), L) if n in host_ms]
        figures[L] = dict(
            host_ms_median=statistics.median(xs) if xs else None,
            host_ms_min=min(xs) if xs else None,
            steps=len(xs),
        )
    return dict(batch=batch, figures=figures, wall_s=wall, output_tokens=generated)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from checkpoints.known_models import DEFAULT_MODEL, resolve_model_path
    from jaxkv.tokenizer import Tokenizer

    tok = Tokenizer.from_files(resolve_model_path(DEFAULT_MODEL) / "tokenizer")
    results = []
    for b in a.batch:
        runs = [run(tok, b, a.lengths, a.window) for _ in range(a.runs)]
        row = dict(batch=b, runs=runs)
        for L in a.lengths:
            med = [r["figures"][L]["host_ms_median"] for r in runs]
            row[f"host_ms_at_{L}"] = statistics.median(med)
        lo, hi = min(a.lengths), max(a.lengths)
        row["flatness"] = row[f"host_ms_at_{hi}"] / row[f"host_ms_at_{lo}"]
        results.append(row)
        print(
            f"batch {b}: "
            + ", ".join(
                f"host {row[f'host_ms_at_{L}']:.2f} ms/step at {L} tokens" for L in a.lengths
            )
            + f"; {hi}/{lo} = {row['flatness']:.2f}x",
            flush=True,
        )
    report = dict(cpu=_cpu_name(), cores=_num_cores(), loadavg=_loadavg(), results=results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
