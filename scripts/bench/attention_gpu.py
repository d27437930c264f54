"""Ragged paged attention on a GPU: correctness of the Pallas GPU kernels
(Triton, and the Hopper Mosaic GPU one on the cases it takes: bfloat16, no
int8 pages) against the reference, decode and prefill-chunk benchmarks of
both side by side with
JAX's bundled Pallas paged attention, the reference under XLA and
jax.nn.dot_product_attention.

    python3 scripts/bench/attention_gpu.py [--out DIR] [--smoke] [--budget-s S]

Writes DIR/bench_attention.json and DIR/bench_attention.md (DIR defaults to
$OUT, else ./bench_out), rewritten after every measurement so a run cut short
still leaves its results. --smoke runs tiny sizes with the Pallas kernels in
interpret mode, so the script can be checked on a CPU.

Decode: batch 1/8/64 x context 1k/4k/16k, 32 query heads, 8 KV heads, head
dim 128, bf16, page size 16, pages scrambled. Time is the median per call over
repeated back-to-back batches of calls (block_until_ready at the end of each).
Bandwidth counts the K/V page bytes a call must read plus q and the output,
as a fraction of a measured device copy (read + write of a 1 GiB array).
Prefill: one 512-token chunk at the end of a 4k context, TFLOP/s counting only
the causal (unmasked) query-key pairs, 4 flops per pair per head dim.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np

from pallas_kernels.ragged_paged_attention import gpu, mosaic_gpu, reference  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

from scripts.bench.attention_gpu_parts import Report, bench, ragged_batch  # noqa: E402

FULL = dict(
    batches=(1, 8, 64),
    contexts=(1024, 4096, 16384),
    heads=32,
    kv_heads=8,
    head_dim=128,
    page_size=16,
    prefill_q=512,
    prefill_ctx=4096,
    copy_mib=1024,
    min_batch_s=0.02,
    reps=7,
)
SMOKE = dict(
    batches=(1, 2),
    contexts=(64, 128),
    heads=4,
    kv_heads=2,
    head_dim=64,
    page_size=16,
    prefill_q=32,
    prefill_ctx=128,
    copy_mib=16,
    min_batch_s=0.0,
    reps=2,
)


def correctness(report, cfg, interpret):
    H, KVH, D, ps = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["page_size"]
    small = cfg is SMOKE
    mixed = (
        ([1, 1, 7, 33, 1, 20], [1, 17, 50, 100, 200, 60])
        if small
        else ([1, 1, 7, 33, 1, 100, 1], [1, 17, 50, 300, 2000, 612, 16384])
    )
    decode = ([1] * 6, [1, 15, 16, 17, 100, 250] if small else [1, 15, 16, 17, 1000, 16384])
    cases = [
        ("mixed", mixed, jnp.bfloat16, {}, False),
        ("decode", decode, jnp.bfloat16, {}, False),
        ("mixed window+softcap", mixed, jnp.float32, dict(sliding_window=48, soft_cap=20.0), False),
        ("decode window", decode, jnp.bfloat16, dict(sliding_window=100), False),
        ("mixed int8", mixed, jnp.bfloat16, {}, True),
        ("decode int8", decode, jnp.bfloat16, {}, True),
    ]
    kernels = [("triton", gpu), ("mosaic_gpu", mosaic_gpu)]
    runs = [
        (c, k)
        for c in cases
        for k in kernels
        if k[0] == "triton" or (c[2] == jnp.bfloat16 and not c[4])
    ]
    for (name, (ql, kl), dtype, kw, int8), (kname, kernel) in runs:
        item = dict(
            case=name,
            kernel=kname,
            dtype=jnp.dtype(dtype).name + ("/int8 pages" if int8 else ""),
            tol=3e-2 if dtype == jnp.bfloat16 else 2e-4,
        )
        try:
            b = ragged_batch(
                np.random.default_rng(len(name)),
                ql,
                kl,
                heads=H,
                kv_heads=KVH,
                head_dim=D,
                page_size=ps,
                dtype=dtype,
                int8=int8,
            )
            kw = dict(sm_scale=D**-0.5, **kw)
            got = kernel.ragged_paged_attention(**b, **kw, interpret=interpret)
            with jax.default_matmul_precision("highest"):
                want = reference.ragged_paged_attention(**b, **kw)
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
            item.update(
                max_abs_err=err,
                max_abs_ref=scale,
                ok=bool(np.isfinite(err) and err <= item["tol"] * max(1.0, scale)),
            )
        except Exception as e:
            item.update(ok=False, error=f"{type(e).__name__}: {e}")
            report.data["errors"].append(
                dict(where=f"correctness {kname} {name}", error=traceback.format_exc())
            )
        report.add("correctness", item)


def copy_bandwidth(report, cfg):
    n = cfg["copy_mib"] * 2**20 // 4
    x = jnp.zeros((n,), jnp.float32)
    f = jax.jit(lambda x: x + 1.0)
    t, _, calls = bench(f, (x,), min_batch_s=cfg["min_batch_s"], reps=cfg["reps"])
    report.add(
        "copy_bandwidth",
        dict(bytes=2 * x.nbytes, seconds=t, gb_s=2 * x.nbytes / t / 1e9, calls=calls),
    )
    return 2 * x.nbytes / t


def decode_bench(report, cfg, copy_bw, interpret, deadline):
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    H, KVH, D, ps = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["page_size"]
    sm_scale = D**-0.5
    for ctx in cfg["contexts"]:
        for B in cfg["batches"]:
            if time.monotonic() > deadline:
                report.data["errors"].append(
                    dict(where=f"decode B={B} ctx={ctx}", error="skipped: time budget spent")
                )
                report.save()
                continue
            rng = np.random.default_rng(B * 100003 + ctx)
            try:
                b = ragged_batch(
                    rng,
                    [1] * B,
                    [ctx] * B,
                    heads=H,
                    kv_heads=KVH,
                    head_dim=D,
                    page_size=ps,
                    dtype=jnp.bfloat16,
                )
            except Exception:
                report.data["errors"].append(
                    dict(where=f"decode data B={B} ctx={ctx}", error=traceback.format_exc())
                )
                continue
            itemsize = 2
            moved = (2 * B * ctx * KVH * D + 2 * B * H * D) * itemsize
            pps = b["block_tables"].shape[1]
            k_splits = math.gcd(16, pps)
            impls = {
                "pallas-gpu (ours)": (
                    jax.jit(
                        functools.partial(
                            gpu.ragged_paged_attention, sm_scale=sm_scale, interpret=interpret
                        )
                    ),
                    (
                        b["q"],
                        b["k_pages"],
                        b["v_pages"],
                        b["kv_lens"],
                        b["block_tables"],
                        b["cu_q_lens"],
                        b["num_seqs"],
                    ),
                ),
                "pallas-mosaic-gpu (ours)": (
                    jax.jit(
                        functools.partial(
                            mosaic_gpu.ragged_paged_attention,
                            sm_scale=sm_scale,
                            interpret=interpret,
                        )
                    ),
                    (
                        b["q"],
                        b["k_pages"],
                        b["v_pages"],
                        b["kv_lens"],
                        b["block_tables"],
                        b["cu_q_lens"],
                        b["num_seqs"],
                    ),
                ),
                "jax pallas paged_attention": (
                    jax.jit(
                        lambda q, k, v, t, l: jax_paged.paged_attention(
                            q * sm_scale,
                            k,
                            v,
                            t,
                            l,
                            k_splits=k_splits,
                            pages_per_compute_block=max(1, min(8, pps // k_splits)),
                            interpret=interpret,
                        )
                    ),
                    (b["q"], b["k_pages"], b["v_pages"], b["block_tables"], b["kv_lens"]),
                ),
                "reference (XLA)": (
                    jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=sm_scale)),
                    (
                        b["q"],
                        b["k_pages"],
                        b["v_pages"],
                        b["kv_lens"],
                        b["block_tables"],
                        b["cu_q_lens"],
                        b["num_seqs"],
                    ),
                ),
            }
            ref_out = None
            for impl, (fn, args) in impls.items():
                row = dict(batch=B, context=ctx, impl=impl)
                try:
                    t, first, calls = bench(
                        fn, args, min_batch_s=cfg["min_batch_s"], reps=cfg["reps"]
                    )
                    out = fn(*args).astype(jnp.float32)
                    if impl.startswith("reference"):
                        ref_out = out
                    row.update(
                        median_us=t * 1e6,
                        first_call_s=first,
                        calls=calls,
                        gb_s=moved / t / 1e9,
                        bw_fraction=moved / t / copy_bw,
                        bytes=moved,
                    )
                    row["_out"] = out
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"
                    report.data["errors"].append(
                        dict(where=f"decode {impl} B={B} ctx={ctx}", error=traceback.format_exc())
                    )
                report.data["decode"].append(row)
            for row in report.data["decode"][-len(impls) :]:
                out = row.pop("_out", None)
                if out is not None and ref_out is not None:
                    row["max_err_vs_ref"] = float(jnp.max(jnp.abs(out - ref_out)))
            report.save()


def prefill_bench(report, cfg, interpret, deadline):
    H, KVH, D, ps = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["page_size"]
    q_len, ctx = cfg["prefill_q"], cfg["prefill_ctx"]
    sm_scale = D**-0.5
    rng = np.random.default_rng(7)
    b = ragged_batch(
        rng, [q_len], [ctx], heads=H, kv_heads=KVH, head_dim=D, page_size=ps, dtype=jnp.bfloat16
    )
    pairs = q_len * (ctx - q_len) + q_len * (q_len + 1) // 2
    flops = 4 * pairs * H * D
    # Contiguous K/V of the same sequence for dot_product_attention, and a
    # bottom-right-aligned causal mask (query i sits at position ctx - q_len + i).
    order = b["block_tables"][0]
    k = b["k_pages"][:, order].reshape(KVH, ctx, D).transpose(1, 0, 2)[None]
    v = b["v_pages"][:, order].reshape(KVH, ctx, D).transpose(1, 0, 2)[None]
    q4 = b["q"][None]
    mask = (jnp.arange(ctx)[None, :] <= (ctx - q_len + jnp.arange(q_len))[:, None])[None, None]
    args7 = (
        b["q"],
        b["k_pages"],
        b["v_pages"],
        b["kv_lens"],
        b["block_tables"],
        b["cu_q_lens"],
        b["num_seqs"],
    )
    impls = {
        "pallas-gpu (ours)": (
            jax.jit(
                functools.partial(
                    gpu.ragged_paged_attention, sm_scale=sm_scale, interpret=interpret
                )
            ),
            args7,
        ),
        "pallas-mosaic-gpu (ours)": (
            jax.jit(
                functools.partial(
                    mosaic_gpu.ragged_paged_attention, sm_scale=sm_scale, interpret=interpret
                )
            ),
            args7,
        ),
        "reference (XLA)": (
            jax.jit(functools.partial(reference.ragged_paged_attention, sm_scale=sm_scale)),
            args7,
        ),
    }
    for name in ("xla", "cudnn"):
        impls[f"jax.nn.dot_product_attention ({name})"] = (
            jax.jit(
                lambda q, k, v, m, name=name: jax.nn.dot_product_attention(
                    q, k, v, mask=m, scale=sm_scale, implementation=name
                )[0]
            ),
            (q4, k, v, mask),
        )
    ref_out = None
    for impl, (fn, args) in impls.items():
        row = dict(q_len=q_len, context=ctx, impl=impl, flops=flops)
        if time.monotonic() > deadline:
            row["error"] = "skipped: time budget spent"
            report.add("prefill", row)
            continue
        try:
            t, first, calls = bench(fn, args, min_batch_s=cfg["min_batch_s"], reps=cfg["reps"])
            out = fn(*args).astype(jnp.float32)
            if ref_out is None:
                ref_out = out
            row.update(
                median_ms=t * 1e3,
                tflops=flops / t / 1e12,
                first_call_s=first,
                calls=calls,
                max_err_vs_first=float(jnp.max(jnp.abs(out - ref_out))),
            )
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            report.data["errors"].append(
                dict(where=f"prefill {impl}", error=traceback.format_exc())
            )
        report.add("prefill", row)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, Pallas kernels in interpret mode (runs on CPU)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="skip the remaining benchmarks after this many seconds",
    )
    a = parser.parse_args(argv)
    start = time.monotonic()
    deadline = start + a.budget_s
    cfg = SMOKE if a.smoke else FULL
    interpret = a.smoke
    dev = jax.devices()[0]
    meta = dict(
        mode="smoke" if a.smoke else "full",
        jax=jax.__version__,
        device=f"{dev.platform}: {getattr(dev, 'device_kind', '?')}",
        python=platform.python_version(),
        config=cfg,
    )
    report = Report(a.out, meta)
    if dev.platform != "gpu" and not a.smoke:
        report.data["errors"].append(
            dict(where="setup", error=f"no GPU ({dev.platform}); use --smoke on CPU")
        )
        report.save()
        print(report.markdown())
        return 1
    steps = [
        ("correctness", lambda: correctness(report, cfg, interpret)),
        ("copy bandwidth", lambda: copy_bandwidth(report, cfg)),
        (
            "decode",
            lambda: decode_bench(
                report, cfg, report.data["copy_bandwidth"]["gb_s"] * 1e9, interpret, deadline
            ),
        ),
        ("prefill", lambda: prefill_bench(report, cfg, interpret, deadline)),
    ]
    for name, step in steps:
        t0 = time.monotonic()
        try:
            step()
        except Exception:
            report.data["errors"].append(dict(where=name, error=traceback.format_exc()))
            report.save()
        print(f"[bench] {name}: {time.monotonic() - t0:.1f}s", flush=True)
    report.data["meta"]["wall_s"] = time.monotonic() - start
    report.save()
    print(report.markdown())
    ok = all(c["ok"] for c in report.data["correctness"])
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
