"""Multi-LoRA throughput: decode at batch 16 and prefill of 512-token
prompts on the default model (SmolLM2-135M), without LoRA and with 0, 1 and
4 distinct rank-16 adapters (every projection targeted) mixed in the batch.

    python scripts/bench/lora.py [--runs 3] [--model smollm2-135m-instruct]

"base" is an engine without LoRA; the others one engine with
enable_lora (max_loras 4, max_lora_rank 16) whose requests name 0, 1 or 4
adapters round robin. Adapters are random PEFT folders written here
(adapter_config.json + adapter_model.safetensors in peft's names), so
nothing is downloaded. Each figure is the median of --runs runs, the
variants interleaved run by run; ratios are to "base". Every run's prompts
are new (no prefix-cache hit). Writes scripts/results/bench_lora_cpu_<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

ROOT = Path(__file__).resolve().parents[2]

VARIANTS = ("base", "lora, 0 adapters", "1 adapter", "4 adapters")
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder for a model of `config` (jaxkv ModelConfig)."""
    from safetensors.numpy import save_file

    E, H, K, D, F = (
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
    )
    dims = dict(
        q_proj=(E, H * D),
        k_proj=(E, K * D),
        v_proj=(E, K * D),
        o_proj=(H * D, E),
        gate_proj=(E, F),
        up_proj=(E, F),
        down_proj=(F, E),
    )
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(config.num_layers):
        for m in MODULES:
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            n_in, n_out = dims[m]
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = (
                rng.standard_normal((rank, n_in)) / np.sqrt(n_in)
            ).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.01 * rng.standard_normal((n_out, rank))).astype(
                np.float32
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            dict(
                peft_type="LORA",
                r=rank,
                lora_alpha=2 * rank,
                target_modules=list(MODULES),
                bias="none",
                task_type="CAUSAL_LM",
            )
        )
    )
    return folder


class Runs:
    """Fresh random prompts per call, and the timed phases on one engine."""

    def __init__(self, vocab_size: int):
        self.rng = np.random.default_rng(0)
        self.vocab = vocab_size

    def prompts(self, n: int, length: int) -> list[list[int]]:
        return [list(map(int, self.rng.integers(100, self.vocab, length))) for _ in range(n)]

    def decode(self, eng, loras, batch: int, prompt: int, steps: int) -> float:
        """Output tok/s of `batch` sequences decoding `steps` tokens each
        (their prefill untimed); request i runs with loras[i % len]."""
        from jaxkv import SamplingParams

        sp = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
        rids = [
            eng.add_request({"prompt_token_ids": p}, sp, lora_request=loras[i % len(loras)])
            for i, p in enumerate(self.prompts(batch, prompt))
        ]
        seqs = [eng.get_request(r) for r in rids]
        while any(not s.num_output_tokens for s in seqs):
            eng.step()
        start = [s.num_output_tokens for s in seqs]
        t0 = time.perf_counter()
        while min(s.num_output_tokens - n for s, n in zip(seqs, start)) < steps:
            eng.step()
        wall = time.perf_counter() - t0
        tokens = sum(s.num_output_tokens - n for s, n in zip(seqs, start))
        for r in rids:
            eng.abort(r)
        eng.step()
        return tokens / wall

    def prefill(self, eng, loras, n: int, length: int) -> float:
        """Prompt tok/s of `n` prompts of `length` tokens submitted together
        (one output token each)."""
        from jaxkv import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        rids = [
            eng.add_request({"prompt_token_ids": p}, sp, lora_request=loras[i % len(loras)])
            for i, p in enumerate(self.prompts(n, length))
        ]
        fin = eng.run_to_completion(rids)
        wall = time.perf_counter() - t0
        if any(fin[r].outputs[0].finish_reason != "length" for r in rids):
            raise RuntimeError(f"a prefill request failed: {[fin[r].error for r in rids]}")
        return n * length / wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/bench/lora.py", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=64, help="decode tokens timed per sequence")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prefill-n", type=int, default=4, help="prompts per prefill run")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    from checkpoints.loader import load_model
    from jaxkv import LLMEngine, LoRARequest
    from jaxkv.config import EngineConfig
    from jaxkv.paths import enable_compilation_cache
    from scripts.bench.common import _cpu_name, _num_cores
    from scripts.bench.peer_jaxkv import jaxkv_model_source

    enable_compilation_cache()
    module, tok = load_model(jaxkv_model_source(a.model))
    cfg = module.config
    common = dict(max_num_seqs=a.batch, max_num_batched_tokens=512, num_pages=1024)
    engines = {"base": LLMEngine(module, tok, EngineConfig(**common))}
    lora_eng = LLMEngine(
        module, tok, EngineConfig(**common, enable_lora=True, max_loras=4, max_lora_rank=a.rank)
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench_lora_"))
    reqs = [
        LoRARequest(f"a{i}", i + 1, str(write_adapter(tmp / f"a{i}", cfg, a.rank, i)))
        for i in range(4)
    ]
    loras = {"base": [None], "lora, 0 adapters": [None], "1 adapter": reqs[:1], "4 adapters": reqs}
    runs = Runs(cfg.vocab_size)
    for v in VARIANTS[1:]:  # read the adapters and fill the slots before timing
        runs.prefill(lora_eng, loras[v], len(loras[v]), 16)
    got = {v: dict(decode=[], prefill=[]) for v in VARIANTS}
    for r in range(a.runs):
        for v in VARIANTS:
            eng = engines.get(v, lora_eng)
            got[v]["decode"].append(runs.decode(eng, loras[v], a.batch, 128, a.steps))
            got[v]["prefill"].append(runs.prefill(eng, loras[v], a.prefill_n, a.prefill_len))
            print(
                f"run {r + 1}: {v:17s} decode {got[v]['decode'][-1]:7.1f} tok/s  "
                f"prefill {got[v]['prefill'][-1]:7.1f} tok/s",
                flush=True,
            )
    med = {v: {k: statistics.median(x) for k, x in d.items()} for v, d in got.items()}
    print(f"\n{a.model}, rank {a.rank}, {_cpu_name()} ({_num_cores()} cores), medians of {a.runs}")
    print(
        f"| variant | decode batch {a.batch} tok/s | vs base | prefill {a.prefill_len} tok/s "
        "| vs base |\n|---|---:|---:|---:|---:|"
    )
    for v in VARIANTS:
        d, pf = med[v]["decode"], med[v]["prefill"]
        print(
            f"| {v} | {d:.1f} | {d / med['base']['decode']:.2f}x | {pf:.1f} | "
            f"{pf / med['base']['prefill']:.2f}x |"
        )
    out = dict(
        date=datetime.date.today().isoformat(),
        cpu=_cpu_name(),
        cores=_num_cores(),
        model=a.model,
        rank=a.rank,
        batch=a.batch,
        steps=a.steps,
        prefill_len=a.prefill_len,
        prefill_n=a.prefill_n,
        runs=got,
        medians=med,
        slot_loads=lora_eng.loras.stats["slot_loads"],
    )
    path = Path(a.json or ROOT / "scripts" / "results" / f"bench_lora_cpu_{out['date']}.json")
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
