"""Pieces of the attention benchmark (scripts/bench/attention_gpu.py): the
report that is rewritten after every measurement, the timing loop, and the
random ragged batch with scrambled pages."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


class Report:
    """Results as JSON and a markdown table, rewritten on every update."""

    def __init__(self, out_dir, meta):
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data = dict(
            meta=meta, correctness=[], copy_bandwidth=None, decode=[], prefill=[], errors=[]
        )

    def add(self, section, item):
        if isinstance(self.data[section], list):
            self.data[section].append(item)
        else:
            self.data[section] = item
        self.save()

    def save(self):
        (self.dir / "bench_attention.json").write_text(json.dumps(self.data, indent=1))
        (self.dir / "bench_attention.md").write_text(self.markdown())

    def markdown(self):
        d = self.data
        lines = [
            f"# Ragged paged attention benchmark ({d['meta'].get('mode')})",
            "",
            f"device: {d['meta'].get('device')}, jax {d['meta'].get('jax')}",
            "",
        ]
        if d["copy_bandwidth"]:
            lines += [f"device copy bandwidth: {d['copy_bandwidth']['gb_s']:.0f} GB/s", ""]
        lines += [
            "## Correctness (GPU kernels vs reference)",
            "",
            "| kernel | case | dtype | max abs err | tol | ok |",
            "|---|---|---|---|---|---|",
        ]
        for c in d["correctness"]:
            lines.append(
                f"| {c.get('kernel', 'triton')} | {c['case']} | {c['dtype']} | "
                f"{c.get('max_abs_err', float('nan')):.2e} | {c['tol']:.0e} | {c['ok']} |"
            )
        lines += [
            "",
            "## Decode",
            "",
            "| batch | context | impl | median us | GB/s | of copy bw | max err vs ref |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in d["decode"]:
            if "error" in r:
                lines.append(
                    f"| {r['batch']} | {r['context']} | {r['impl']} | error: "
                    f"{r['error'][:80]} | | | |"
                )
                continue
            err = r.get("max_err_vs_ref")
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['impl']} | {r['median_us']:.1f} "
                f"| {r['gb_s']:.0f} | {r['bw_fraction']:.2f} | "
                f"{'' if err is None else f'{err:.1e}'} |"
            )
        lines += [
            "",
            "## Prefill chunk",
            "",
            "| q_len | context | impl | median ms | TFLOP/s |",
            "|---|---|---|---|---|",
        ]
        for r in d["prefill"]:
            if "error" in r:
                lines.append(
                    f"| {r['q_len']} | {r['context']} | {r['impl']} | error: {r['error'][:80]} | |"
                )
                continue
            lines.append(
                f"| {r['q_len']} | {r['context']} | {r['impl']} | {r['median_ms']:.3f} "
                f"| {r['tflops']:.1f} |"
            )
        if d["errors"]:
            lines += ["", "## Errors", ""] + [
                f"- {e['where']}: {e['error'][:300]}" for e in d["errors"]
            ]
        return "\n".join(lines) + "\n"


def bench(fn, args, *, min_batch_s, reps):
    """-> (median seconds per call, compile+first call seconds, calls timed)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        if dt >= min_batch_s or n >= 4096:
            break
        n = min(4096, max(2 * n, int(n * min_batch_s / max(dt, 1e-6)) + 1))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times), first, n * reps


def ragged_batch(rng, q_lens, kv_lens, *, heads, kv_heads, head_dim, page_size, dtype, int8=False):
    """Random ragged batch with scrambled pages (page 0 unused). Returns the
    kernel-signature dict of jnp arrays (k_scale / v_scale when int8)."""
    S = len(q_lens)
    need = [-(-k // page_size) for k in kv_lens]
    pps = max(need)
    total = sum(need) + 1
    perm = rng.permutation(np.arange(1, total))
    tables = np.zeros((S, pps), np.int32)
    i = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[i : i + n]
        i += n
    shape = (kv_heads, total, page_size, head_dim)
    out = dict(
        q=rng.standard_normal((sum(q_lens), heads, head_dim), np.float32),
        kv_lens=np.asarray(kv_lens, np.int32),
        block_tables=tables,
        cu_q_lens=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        num_seqs=np.int32(S),
    )
    if int8:
        out.update(
            k_pages=rng.integers(-127, 128, shape).astype(np.int8),
            v_pages=rng.integers(-127, 128, shape).astype(np.int8),
            k_scale=rng.uniform(0.005, 0.02, shape[:3]).astype(np.float32),
            v_scale=rng.uniform(0.005, 0.02, shape[:3]).astype(np.float32),
        )
    else:
        out.update(
            k_pages=rng.standard_normal(shape, np.float32),
            v_pages=rng.standard_normal(shape, np.float32),
        )
    cast = {"q": dtype} if int8 else {"q": dtype, "k_pages": dtype, "v_pages": dtype}
    return {k: jnp.asarray(v, dtype=cast.get(k)) for k, v in out.items()}
