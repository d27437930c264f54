"""The subprocess side of the scale-out tests: a process whose device count
the test chose (XLA_FLAGS, set before jax starts), or one process of a
multi-process job. Prints one JSON line (process 0 only).

    python -m tests.helpers.sharding_worker tp --tp 1,2,4 [--backend pallas] [--gguf PATH]
    python -m tests.helpers.sharding_worker tp --moe --tp 2,ep2,ep4   (ep: expert parallel)
    python -m tests.helpers.sharding_worker job --process-id I --coordinator 127.0.0.1:PORT
        [--async-scheduling]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from jaxkv.config import EngineConfig, ModelConfig

# A random GQA model with 8 query and 2 KV heads (KV heads replicated at
# tensor_parallel_size 4) and head_dim 64 (the Pallas TPU kernel's minimum).
TINY = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    eos_token_ids=(),
)
# Every per-layer feature of the one decoder at once (Gemma 3's local and
# global layers, RoPE bases, norms and scales, Gemma 2's soft caps, gpt-oss's
# learned sinks), on TINY's shapes.
FAMILY = dataclasses.replace(
    TINY,
    architecture="gemma3",
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=8,
    rope_theta=1e6,
    rope_local_theta=1e4,
    norm_offset=1.0,
    post_norms=True,
    qk_norm=True,
    hidden_act="gelu_tanh",
    embed_scale=True,
    query_pre_attn_scalar=48.0,
    attn_logit_softcap=20.0,
    final_logit_softcap=15.0,
    attention_sinks=True,
    tie_word_embeddings=True,
)
# A mixture of experts on TINY's attention: a dense layer, then 8 experts
# (top 2) beside a sigmoid-gated shared expert, as Qwen2-MoE mixes them.
MOE = dataclasses.replace(
    TINY,
    architecture="qwen2_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=96,
    sparse_layers=(False, True),
)
# A pool small enough that 16 prompts preempt, a token budget that chunks
# the longer prompts, and shared prefixes that hit the prefix cache.
ENGINE = dict(warmup=False, num_pages=24, page_size=8, max_num_seqs=16, max_num_batched_tokens=64)


def prompts(vocab_size: int, n: int = 16) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prefixes = [list(map(int, rng.integers(1, vocab_size, k))) for k in (24, 40)]
    return [
        (prefixes[i % 2] if i % 3 else [])
        + list(map(int, rng.integers(1, vocab_size, int(rng.integers(1, 30)))))
        for i in range(n)
    ]


def run(model, tp: int, backend: str, max_tokens: int, n_prompts: int = 16, **engine) -> dict:
    """Greedy tokens of the test prompts at `tp`, with what the run did and
    what one device holds."""
    from jaxkv.core.engine import LLMEngine
    from jaxkv.core.sampling_params import SamplingParams
    from jaxkv.model import memory
    from jaxkv.sharding import shard_nbytes

    eng = LLMEngine(
        model,
        None,
        EngineConfig(**{**ENGINE, **engine}, tensor_parallel_size=tp, attention_backend=backend),
    )
    ps = prompts(model.config.vocab_size, n_prompts)
    ids = [eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0)) for p in ps]
    final = eng.run_to_completion(ids)
    planned = memory.per_device_bytes(
        model.config,
        tp,
        "float32",
        engine.get("kv_dtype"),
        num_pages=eng.cache_config.num_pages,
        page_size=eng.cache_config.page_size,
    )
    eng.shutdown()
    return dict(
        tokens=[final[i].outputs[0].token_ids for i in ids],
        preemptions=eng.scheduler.num_preemptions,
        prefix_hit_tokens=eng.bm.prefix_hit_tokens,
        partial_prefills=eng.stats["partial_prefills"],
        overlapped_steps=eng.stats["overlapped_steps"],
        params_bytes=shard_nbytes(eng.runner.state),
        kv_bytes=shard_nbytes(eng.runner.cache),
        planned=planned,
        shards=len(eng.runner.cache.k[0].addressable_shards),
    )


def load(gguf: str | None, layers: int | None = None, family: bool = False, moe: bool = False):
    """The tiny random model (FAMILY's with `family`), or the GGUF's; with
    `layers`, only that many layers (the GGUF's first ones: the same
    weights and head layout), fewer to compile."""
    from jaxkv.model.llama import Llama

    if gguf is None:
        cfg = FAMILY if family else MOE if moe else TINY
        if layers is not None:
            cfg = dataclasses.replace(cfg, num_layers=layers, layer_types=cfg.layer_types[:layers])
        return Llama.random_init(cfg, seed=1)
    from checkpoints import load_checkpoint

    config, params, _ = load_checkpoint(gguf)
    if layers is not None:
        config = dataclasses.replace(config, num_layers=layers)
        params = {
            k: v
            for k, v in params.items()
            if not k.startswith("layers.") or int(k.split(".")[1]) < layers
        }
    return Llama.from_params(config, params)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("tp", "job"))
    p.add_argument("--tp", default="1")
    p.add_argument("--backend", default="reference")
    p.add_argument("--gguf", default=None)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--kv-dtype", default=None, help="or several, comma-separated: keys kv:tp")
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--coordinator", default=None)
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--family", action="store_true", help="the FAMILY model instead of TINY")
    p.add_argument("--moe", action="store_true", help="the MOE model instead of TINY")
    p.add_argument("--expert-parallel", action="store_true", help="job: experts split whole")
    a = p.parse_args(argv)
    engine = (
        {} if a.kv_cache_memory is None else dict(num_pages=None, kv_cache_memory=a.kv_cache_memory)
    )
    if a.num_pages is not None:
        engine["num_pages"] = a.num_pages
    if a.async_scheduling:
        engine["async_scheduling"] = True
    if a.expert_parallel:
        engine["enable_expert_parallel"] = True
    if a.mode == "job":
        from jaxkv.worker.distributed import init_distributed

        init_distributed(a.coordinator, a.num_processes, a.process_id)
        import jax

        tp = jax.device_count()
        from jaxkv.core.engine import LLMEngine

        model = load(a.gguf, moe=a.moe)
        if a.process_id:
            eng = LLMEngine(
                model,
                None,
                EngineConfig(
                    **{**ENGINE, **engine}, tensor_parallel_size=tp, attention_backend=a.backend
                ),
            )
            assert eng.follow()
            return 0
        out = run(model, tp, a.backend, a.max_tokens, a.prompts, **engine)
        out["devices"] = tp
        out["processes"] = jax.process_count()
    else:
        model = load(a.gguf, a.layers, a.family, a.moe)
        kvs = [None] if a.kv_dtype is None else a.kv_dtype.split(",")
        out = {
            (tp if kv is None else f"{kv}:{tp}"): run(
                model,
                int(tp.removeprefix("ep")),
                a.backend,
                a.max_tokens,
                a.prompts,
                **engine,
                **({"enable_expert_parallel": True} if tp.startswith("ep") else {}),
                **({} if kv is None else {"kv_dtype": kv}),
            )
            for kv in kvs
            for tp in a.tp.split(",")
        }
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
