"""Prefill attention of one layer on CPU: jaxkv's native kernel (what the
engine runs, `cpu.py`, where it is built) and its jnp dense causal path
(the block size the engine picks for a lone prompt) beside torch's fused
`scaled_dot_product_attention(is_causal=True, enable_gqa=True)`, on
random inputs of one shape, interleaved, medians of `--runs`.

    python scripts/bench/prefill_attention.py [--lengths 1024,4096] [--runs 7]

Defaults are SmolLM2-135M's heads (9 query, 3 KV, head_dim 64). torch is
the test extra's oracle, not a dependency of jaxkv.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,4096", help="fresh prompt lengths, comma separated")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--runs", type=int, default=7)
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import torch

    # By module path: the package re-exports a function of the same name.
    dense = importlib.import_module("pallas_kernels.ragged_paged_attention.dense")
    cpu = importlib.import_module("pallas_kernels.ragged_paged_attention.cpu")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    H, K, D, ps = a.heads, a.kv_heads, a.head_dim, a.page_size
    rng = np.random.default_rng(0)
    for T in (int(x) for x in a.lengths.split(",")):
        P = -(-T // ps)
        q = rng.standard_normal((T, H, D), np.float32)
        k = rng.standard_normal((K, P * ps, D), np.float32)
        v = rng.standard_normal((K, P * ps, D), np.float32)
        args = (
            jnp.asarray(q),
            jnp.asarray(k.reshape(K, P, ps, D)),
            jnp.asarray(v.reshape(K, P, ps, D)),
            jnp.array([T], jnp.int32),
            jnp.arange(P, dtype=jnp.int32)[None],
            jnp.array([0, T], jnp.int32),
            jnp.array(1, jnp.int32),
        )
        bq = dense.dense_block(T, 1)
        fns = dict(
            dense=jax.jit(lambda *x: dense.dense_prefill(*x, block_q=bq, sm_scale=D**-0.5)[0])
        )
        if cpu.available():
            fns["native"] = jax.jit(lambda *x: cpu.dense_prefill(*x, sm_scale=D**-0.5)[0])
        tq = torch.from_numpy(q).permute(1, 0, 2)[None]
        tk, tv = (torch.from_numpy(x[:, :T])[None] for x in (k, v))

        def run_torch():
            with torch.inference_mode():
                return torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, is_causal=True, enable_gqa=True
                )

        ref = run_torch()[0].permute(1, 0, 2).numpy()
        err = 0.0
        for name, fn in fns.items():
            err = max(err, float(np.abs(np.asarray(fn(*args)) - ref).max()))
            if err > 1e-3:
                raise SystemExit(f"T={T}: jaxkv {name} and torch differ by {err}")
        times = {n: [] for n in (*fns, "torch")}
        for _ in range(a.runs):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn(*args).block_until_ready()
                times[name].append(time.perf_counter() - t)
            t = time.perf_counter()
            run_torch()
            times["torch"].append(time.perf_counter() - t)
        ms = {n: statistics.median(x) * 1e3 for n, x in times.items()}
        print(
            f"T={T}: "
            + ", ".join(
                f"jaxkv {n}{f' (block {bq})' if n == 'dense' else ''} {ms[n]:.1f} ms "
                f"({ms['torch'] / ms[n]:.2f}x torch)"
                for n in fns
            )
            + f", torch sdpa {ms['torch']:.1f} ms (max |diff| {err:.1e})",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
