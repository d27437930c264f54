"""Decode attention of one layer on CPU, by KV page format: jaxkv's native
kernel (`cpu.py`, what the engine runs on CPU for every format) and the
jnp reference (what quantized caches ran on before the kernel read them)
over float32, bfloat16, int8, int4 and fp8 pages, beside torch's
`scaled_dot_product_attention` on contiguous float32 K/V (the peer), on
random inputs, interleaved, medians of `--runs`.

    python scripts/bench/decode_attention.py [--batch 16] [--context 4096] [--runs 7]

Defaults: batch 16 at 4k-token contexts, SmolLM2-135M's heads (9 query,
3 KV, head_dim 64), page size 16, pages scrambled. Bytes are the K/V page
bytes a call reads (scales included). Writes one JSON (the CPU model
included) with --json. torch is the test extra's oracle, not a dependency.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

FORMATS = ("float32", "bfloat16", "int8", "int4", "fp8_e4m3", "fp8_e5m2")


def make_pages(k, v, fmt):
    """float32 K/V [KVH, P, ps, D] -> (k_pages, v_pages, k_scale, v_scale) of `fmt`."""
    import jax.numpy as jnp

    fm = importlib.import_module("pallas_kernels.ragged_paged_attention.kv_formats")
    if fmt in ("float32", "bfloat16"):
        return jnp.asarray(k, fmt), jnp.asarray(v, fmt), None, None
    if fmt in fm.FP8_DTYPES:
        dt = fm.FP8_DTYPES[fmt]
        return jnp.asarray(k).astype(dt), jnp.asarray(v).astype(dt), None, None
    kp, ks = fm.quantize_vectors(jnp.asarray(k), fmt)
    vp, vs = fm.quantize_vectors(jnp.asarray(v), fmt)
    return kp, vp, ks, vs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--no-reference", action="store_true", help="skip the jnp reference")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    cpu = importlib.import_module("pallas_kernels.ragged_paged_attention.cpu")
    reference = importlib.import_module("pallas_kernels.ragged_paged_attention.reference")
    if not cpu.available():
        raise SystemExit(
            "the native CPU kernel is not built here: "
            + str(importlib.import_module("pallas_kernels.native").unavailable("rpa_cpu"))
        )
    B, L, H, K, D, ps = a.batch, a.context, a.heads, a.kv_heads, a.head_dim, a.page_size
    W = -(-L // ps)
    P = B * W + 1
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, D), np.float32)
    k = rng.standard_normal((K, P, ps, D), np.float32)
    v = rng.standard_normal((K, P, ps, D), np.float32)
    tables = (1 + rng.permutation(B * W)).reshape(B, W).astype(np.int32)  # page 0: trash
    meta = (
        jnp.full((B,), L, jnp.int32),
        jnp.asarray(tables),
        jnp.arange(B + 1, dtype=jnp.int32),
        jnp.int32(B),
    )
    kw = dict(sm_scale=D**-0.5)

    fns, nbytes, oracle = {}, {}, {}
    for fmt in a.formats.split(","):
        kp, vp, ks, vs = make_pages(k, v, fmt)
        args = (jnp.asarray(q), kp, vp) + meta
        nbytes[fmt] = (
            2
            * B
            * L
            * K
            * (kp.shape[-1] * kp.dtype.itemsize + (ks.dtype.itemsize if ks is not None else 0))
        )
        fns[f"native {fmt}"] = (
            jax.jit(
                lambda *x, ks=ks, vs=vs: cpu.ragged_paged_attention(
                    *x, k_scale=ks, v_scale=vs, **kw
                )
            ),
            args,
        )
        if not a.no_reference:
            fns[f"reference {fmt}"] = (
                jax.jit(
                    lambda *x, ks=ks, vs=vs: reference.ragged_paged_attention(
                        *x, k_scale=ks, v_scale=vs, all_decode=True, **kw
                    )
                ),
                args,
            )
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        tq = torch.from_numpy(q)[:, :, None]  # [B, H, 1, D]
        kk = k[:, tables].reshape(K, B, W * ps, D)[:, :, :L].transpose(1, 0, 2, 3)
        vv = v[:, tables].reshape(K, B, W * ps, D)[:, :, :L].transpose(1, 0, 2, 3)
        tk, tv = (
            torch.from_numpy(np.ascontiguousarray(kk)),
            torch.from_numpy(np.ascontiguousarray(vv)),
        )

        def run_torch():
            with torch.inference_mode():
                return torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, scale=D**-0.5, enable_gqa=True
                )

        want = run_torch()[:, :, 0].numpy()
        for name, (fn, args) in fns.items():  # agreement with the peer (format error aside)
            oracle[name] = float(np.abs(np.asarray(fn(*args)) - want).max())
    times = {n: [] for n in fns}
    if torch is not None:
        times["torch sdpa float32"] = []
    for fn, args in fns.values():
        fn(*args).block_until_ready()  # compile
    for _ in range(a.runs):
        for name, (fn, args) in fns.items():
            t = time.perf_counter()
            fn(*args).block_until_ready()
            times[name].append(time.perf_counter() - t)
        if torch is not None:
            t = time.perf_counter()
            run_torch()
            times["torch sdpa float32"].append(time.perf_counter() - t)
    ms = {n: statistics.median(x) * 1e3 for n, x in times.items()}
    base = ms["native float32"] if "native float32" in ms else None
    rows = []
    for name, t in ms.items():
        fmt = name.split()[-1]
        row = dict(
            name=name,
            ms=round(t, 3),
            kv_mib=round(nbytes.get(fmt, nbytes.get("float32", 0)) / 2**20, 1),
        )
        if base:
            row["speed_vs_native_f32"] = round(base / t, 2)
        if name in oracle:
            row["max_abs_diff_vs_torch_f32"] = round(oracle[name], 4)
        rows.append(row)
        print(
            f"{name:24s} {t:8.2f} ms  {row['kv_mib']:7.1f} MiB KV"
            + (f"  {row['speed_vs_native_f32']:.2f}x native f32" if base else "")
            + (f"  max|diff| vs torch {oracle[name]:.3g}" if name in oracle else ""),
            flush=True,
        )
    if a.json:
        cpu_name = next(
            (
                l.split(":", 1)[1].strip()
                for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")
            ),
            platform.processor(),
        )
        Path(a.json).write_text(
            json.dumps(
                dict(
                    what="decode attention, one layer",
                    cpu=cpu_name,
                    batch=B,
                    context=L,
                    heads=H,
                    kv_heads=K,
                    head_dim=D,
                    page_size=ps,
                    runs=a.runs,
                    jax=jax.__version__,
                    rows=rows,
                ),
                indent=1,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
