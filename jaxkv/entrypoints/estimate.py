"""`jaxkv estimate`: the KV cache size formula term by term, what fits a
memory budget beside the weights, with --tensor-parallel-size what one
device of the split holds, and for a mixture of experts the experts'
weights apart from the rest and the parameters one token runs through."""

from __future__ import annotations

from jaxkv.config import KV_DTYPES
from jaxkv.entrypoints.cli_options import parse_size


def _per_device_report(cfg, a) -> int:
    """Print what one device of `a.tensor_parallel_size` holds; returns its weight bytes."""
    from jaxkv.model import memory

    tp, ps = a.tensor_parallel_size, a.page_size
    pages = a.batch * -(-a.context // ps) + 1  # + the trash page
    one = memory.per_device_bytes(cfg, 1, a.weight_dtype, a.kv_dtype, pages, ps)
    pd = memory.per_device_bytes(cfg, tp, a.weight_dtype, a.kv_dtype, pages, ps)
    print(
        f"Split over {tp} devices (tensor parallel; {pages:,} pages of {ps} tokens for "
        f"batch {a.batch} at context {a.context:,}):\n"
    )
    print("| bytes | one device | per device of " + str(tp) + " |\n|---|---|---|")
    for k in ("params", "kv", "total"):
        print(
            f"| {k} | {one[k]:,} ({one[k] / 2**30:.2f} GiB) | {pd[k]:,} ({pd[k] / 2**30:.2f} GiB) |"
        )
    print()
    return pd["params"]


def _hybrid_report(cfg, geom, full: int, a) -> None:
    """The hybrid pool's terms, for a model whose layers mix global ones
    with one sliding window (`jaxkv.core.scheduling.seats`)."""
    from jaxkv.config import EngineConfig
    from jaxkv.model import memory
    from jaxkv.model.pool_sizing import hybrid_plan

    engine = EngineConfig(page_size=a.page_size, max_num_seqs=a.batch, warmup=False)
    local, ring, _ = hybrid_plan(engine, cfg)
    if not local:
        return
    _, kv, d = geom
    n_global, held = cfg.num_layers - len(local), min(a.context, ring * a.page_size)
    g = memory.kv_cache_bytes(n_global, kv, d, a.context, a.batch, a.kv_dtype)
    w = memory.kv_cache_bytes(len(local), kv, d, held, a.batch, a.kv_dtype)
    print(
        f"\nHybrid pool (the engine's default; --no-hybrid-kv-cache keeps every page): the "
        f"{len(local)} sliding layers (window {cfg.sliding_window}) keep a ring of {ring} pages "
        f"per sequence, the window plus a chunk of {engine.max_num_batched_tokens} tokens.\n"
    )
    print("| term | bytes |\n|---|---|")
    print(f"| {n_global} global layers x {a.context:,} tokens | {g:,} |")
    print(f"| {len(local)} sliding layers x {held:,} tokens | {w:,} |")
    print(
        f"| total | {g + w:,} ({(g + w) / 2**30:.3f} GiB, {(g + w) / full:.1%} of every page kept) |"
    )


def _experts_report(cfg, a) -> None:
    """A mixture of experts' weights: the experts apart from the rest, in
    all and (with --tensor-parallel-size) per device, and the parameters
    one token runs through (k of X experts + shared expert + the rest)."""
    from jaxkv.model import memory

    tp, X, k = a.tensor_parallel_size, cfg.num_experts, cfg.num_experts_per_tok
    total, b = memory.param_count(cfg), memory.dtype_bytes(a.weight_dtype)
    experts, active = memory.mlp_params(cfg)["experts"], memory.active_param_count(cfg)
    pd = memory.per_device_bytes(cfg, tp, a.weight_dtype)
    sparse = sum(map(cfg.layer_sparse, range(cfg.num_layers)))
    rows = [
        (f"experts ({sparse} layers x {X})", experts, pd["experts"]),
        (
            "the rest (attention, routers, norms, embeddings, shared and dense MLPs)",
            total - experts,
            pd["params"] - pd["experts"],
        ),
        ("total", total, pd["params"]),
    ]
    dev = f" bytes per device of {tp} |" if tp > 1 else ""
    print(f"\nWeights of the mixture of experts ({a.weight_dtype}):\n")
    print(f"| term | parameters | bytes |{dev}\n|---|---|---|{'---|' if dev else ''}")
    for name, n, d in rows:
        print(
            f"| {name} | {n:,} ({n / 1e9:.2f} B) | {n * b:,} ({n * b / 2**30:.2f} GiB) |"
            + (f" {d:,} ({d / 2**30:.2f} GiB) |" if dev else "")
        )
    shared = " + the shared expert" if cfg.shared_expert_intermediate_size else ""
    print(
        f"\nActive per token: {active:,} parameters ({active / 1e9:.2f} B, {active / total:.1%}): "
        f"{k} of {X} experts in each sparse layer{shared} + all the rest."
    )


def cmd_estimate(a) -> int:
    from jaxkv.model import memory
    from jaxkv.sharding import check_tensor_parallel

    if a.layers is not None:
        if a.kv_heads is None or a.head_dim is None:
            raise ValueError("--layers needs --kv-heads and --head-dim too")
        geom, name, cfg = (a.layers, a.kv_heads, a.head_dim), "explicit", None
        wbytes = a.weight_bytes or 0
    else:
        from checkpoints import load_config
        from checkpoints.known_models import resolve_model_path

        cfg = load_config(resolve_model_path(a.model))
        geom, name = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), a.model
        wbytes = (
            a.weight_bytes
            if a.weight_bytes is not None
            else memory.weight_bytes(cfg, a.weight_dtype)
        )
    if a.tensor_parallel_size > 1:
        if cfg is None:
            raise ValueError("--tensor-parallel-size needs --model: its heads decide the split")
        wbytes = _per_device_report(cfg, a) if a.weight_bytes is None else a.weight_bytes
        geom = (
            cfg.num_layers,
            check_tensor_parallel(cfg, a.tensor_parallel_size) // a.tensor_parallel_size,
            cfg.head_dim,
        )
        name = f"{name}, per device of {a.tensor_parallel_size}"
    br = memory.kv_cache_breakdown(*geom, a.context, a.batch, a.kv_dtype)
    print(
        f"KV cache of {name}: 2 x L x KVH x D x tokens x batch x bytes/element"
        f"{' + scales' if br.scale_bytes else ''}\n"
    )
    print(br.table())
    if cfg is not None and cfg.num_heads != cfg.num_kv_heads and a.tensor_parallel_size == 1:
        mha = memory.kv_cache_bytes(
            cfg.num_layers, cfg.num_heads, cfg.head_dim, a.context, a.batch, a.kv_dtype
        )
        print(
            f"\nGQA saves {cfg.num_heads // cfg.num_kv_heads}x: the same model with "
            f"{cfg.num_heads} KV heads (MHA) would need {mha:,} bytes."
        )
    if cfg is not None:
        _hybrid_report(cfg, geom, br.total_bytes, a)
    if cfg is not None and cfg.num_experts:
        _experts_report(cfg, a)
    if a.memory:
        budget = a.memory
        mb = memory.max_batch(geom, a.context, budget, wbytes, a.kv_dtype, page_size=a.page_size)
        mc = memory.max_context(geom, a.batch, budget, wbytes, a.kv_dtype, page_size=a.page_size)
        print(
            f"\nIn {budget:,} bytes beside {wbytes:,} bytes of weights "
            f"(pages of {a.page_size} tokens):"
        )
        print(f"- largest batch at context {a.context:,}: {mb:,}")
        print(
            f"- longest context at batch {a.batch}: {mc:,} tokens"
            + (f" (the model's maximum is {cfg.max_position_embeddings:,})" if cfg else "")
        )
    return 0


def add_estimate_command(subparsers) -> None:
    e = subparsers.add_parser(
        "estimate",
        help="KV cache size, term by term, and what fits a budget",
        description="KV bytes = 2 x layers x KV heads x head_dim x tokens x batch x "
        "bytes per element (+ scales: per token for int8 / int4, per KV head for fp8). Give a model (name or "
        "path) or explicit --layers/--kv-heads/--head-dim.",
    )
    e.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    e.add_argument("--layers", type=int, default=None, help="explicit number of layers")
    e.add_argument("--kv-heads", type=int, default=None, help="explicit number of KV heads")
    e.add_argument("--head-dim", type=int, default=None, help="explicit head dimension")
    e.add_argument(
        "--context", type=int, default=4096, help="tokens per sequence (default: %(default)s)"
    )
    e.add_argument("--batch", type=int, default=1, help="sequences (default: %(default)s)")
    e.add_argument(
        "--kv-dtype",
        default="bfloat16",
        choices=list(KV_DTYPES),
        help="KV element type (default: %(default)s)",
    )
    e.add_argument(
        "--memory",
        type=parse_size,
        default=None,
        help="device memory budget (e.g. 24GB, 80GiB): report the largest batch and "
        "longest context that fit beside the weights",
    )
    e.add_argument(
        "--weight-dtype", default="bfloat16", help="for the weight bytes (default: %(default)s)"
    )
    e.add_argument(
        "--weight-bytes",
        type=parse_size,
        default=None,
        help="weight bytes to set aside (default: computed from the model)",
    )
    e.add_argument("--page-size", type=int, default=16, help="KV page size (default: %(default)s)")
    e.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices the model is split over: figures and --memory per device "
        "(default: %(default)s)",
    )
    e.set_defaults(func=cmd_estimate)
