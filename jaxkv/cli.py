"""The `jaxkv` command.

    jaxkv generate "What is a KV cache?" [--model M] [--max-tokens N] [--stream]
    jaxkv chat [--model M]
    jaxkv batch IN.jsonl OUT.jsonl [--model M]
    jaxkv convert SRC DST [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import logging
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="model name (smollm2-135m-instruct, fetched and converted once into "
                        "$JAXKV_CACHE, default ~/.cache/jaxkv) or a path: Hugging Face folder, "
                        "GGUF file or jaxkv checkpoint (default: %(default)s)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="weight and activation dtype (default: %(default)s)")
    g.add_argument("--quantize", default=None, choices=["int8", "w8a8"],
                   help="int8: weight-only int8 matmul weights with per-channel scales (a "
                        "quarter of the fp32 bytes; for accelerators). w8a8: int8 x int8 dots "
                        "for steps of 16+ rows (faster batched decode on CPU), fp32 below")
    g.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "int8"],
                   help="KV cache dtype (default: same as --dtype)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"],
                   help="auto: the Pallas kernel on TPU/GPU, the jnp reference on CPU; pallas on "
                        "CPU runs the kernels in interpret mode (slow, for testing)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="most sequences in one step (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one step; longer prompts are prefilled in chunks "
                        "(default: %(default)s)")
    g.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes for the KV cache (default: a fraction of free device memory, "
                        "or 1 GiB where the device does not report it)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="cap on prompt + output tokens (default: the model's context)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV pages of shared prompt prefixes")
    g.add_argument("-v", "--verbose", action="store_true", help="log engine set-up")


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help="most new tokens per answer (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p x the top probability (0: off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="(1: off)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable); cut from the output")


def _make_engine(a):
    from jaxkv.engine import LLMEngine
    return LLMEngine.from_pretrained(
        a.model, dtype=a.dtype, kv_dtype=a.kv_dtype, quantize=a.quantize,
        attention_backend=a.attention_backend,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        kv_cache_memory=a.kv_cache_memory, max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching)


def _params(a):
    from jaxkv.sequence import SamplingParams
    return SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                          top_p=a.top_p, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                          seed=a.seed, stop=a.stop)


def _stream(engine, prompt, params, raw: bool) -> str:
    """Generate one answer, printing text as it arrives; returns the text."""
    rid = engine.add_request(prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            if o.error:
                raise SystemExit(f"error: {o.error}")
            d = o.outputs[0].delta_text
            text += d
            if raw:
                print(d, end="", flush=True)
    if raw:
        print()
    return text


def _chat_prompt(engine, messages):
    tok = engine.tokenizer
    if tok is None or not tok.chat_template:
        return None
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def cmd_generate(a) -> int:
    engine = _make_engine(a)
    params = _params(a)
    prompt = a.prompt
    if not a.raw:
        chat = _chat_prompt(engine, [{"role": "user", "content": a.prompt}])
        prompt = chat or prompt
    if a.stream:
        _stream(engine, prompt, params, raw=True)
        return 0
    rid = engine.add_request(prompt, params)
    out = engine.run_to_completion([rid])[rid]
    if out.error:
        print(f"error: {out.error}", file=sys.stderr)
        return 2
    print(out.outputs[0].text)
    return 0


def cmd_chat(a) -> int:
    engine = _make_engine(a)
    params = _params(a)
    messages = []
    if a.system:
        messages.append({"role": "system", "content": a.system})
    print("jaxkv chat: type a message, empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = _chat_prompt(engine, messages)
        if prompt is None:
            raise SystemExit("error: this model has no chat template")
        reply = _stream(engine, prompt, params, raw=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_batch(a) -> int:
    from jaxkv.batch import run_batch
    engine = _make_engine(a)
    defaults = {"max_tokens": a.max_tokens, "temperature": a.temperature}
    counts = run_batch(engine, a.input, a.output, defaults=defaults, progress=not a.quiet)
    print(f"wrote {counts['written']} records ({counts['errors']} errors), "
          f"skipped {counts['skipped']} already done", file=sys.stderr)
    return 0


def cmd_convert(a) -> int:
    from checkpoints.convert import convert
    convert(a.src, a.dst, a.dtype)
    return 0


def _size(text: str) -> int:
    """'24GB', '512MiB', '1e9' -> bytes."""
    t = text.strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[:-len(u)]) * m)
    return int(float(t))


def cmd_estimate(a) -> int:
    from jaxkv import memory

    if a.layers is not None:
        if a.kv_heads is None or a.head_dim is None:
            raise ValueError("--layers needs --kv-heads and --head-dim too")
        geom, name, cfg = (a.layers, a.kv_heads, a.head_dim), "explicit", None
        wbytes = a.weight_bytes or 0
    else:
        from checkpoints import load_config
        from jaxkv.llm import resolve_model_path
        cfg = load_config(resolve_model_path(a.model))
        geom, name = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim), a.model
        wbytes = a.weight_bytes if a.weight_bytes is not None else \
            memory.weight_bytes(cfg, a.weight_dtype)
    br = memory.kv_cache_breakdown(*geom, a.context, a.batch, a.kv_dtype)
    print(f"KV cache of {name}: 2 x L x KVH x D x tokens x batch x bytes/element"
          f"{' + scales' if br.scale_bytes else ''}\n")
    print(br.table())
    if cfg is not None and cfg.num_heads != cfg.num_kv_heads:
        mha = memory.kv_cache_bytes(cfg.num_layers, cfg.num_heads, cfg.head_dim, a.context,
                                    a.batch, a.kv_dtype)
        print(f"\nGQA saves {cfg.num_heads // cfg.num_kv_heads}x: the same model with "
              f"{cfg.num_heads} KV heads (MHA) would need {mha:,} bytes.")
    if a.memory:
        budget = _size(a.memory)
        mb = memory.max_batch(geom, a.context, budget, wbytes, a.kv_dtype, page_size=a.page_size)
        mc = memory.max_context(geom, a.batch, budget, wbytes, a.kv_dtype, page_size=a.page_size)
        print(f"\nIn {budget:,} bytes beside {wbytes:,} bytes of weights "
              f"(pages of {a.page_size} tokens):")
        print(f"- largest batch at context {a.context:,}: {mb:,}")
        print(f"- longest context at batch {a.batch}: {mc:,} tokens"
              + (f" (the model's maximum is {cfg.max_position_embeddings:,})" if cfg else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxkv", description="LLM inference in JAX on a paged KV cache.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="answer one prompt",
                       description="Answer one prompt (with the model's chat template unless --raw).")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without chat template")
    _engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the chat template")
    c.add_argument("--system", default=None, help="system message")
    _engine_args(c)
    _sampling_args(c, max_tokens=512)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("batch", help="generate for a JSONL file, resumable",
                       description="Each input line: {\"prompt\": ...} or {\"messages\": [...]} plus "
                                   "optional SamplingParams fields. Output: one JSON record per "
                                   "input line, in order; re-running resumes.")
    b.add_argument("input", help="input JSONL")
    b.add_argument("output", help="output JSONL (appended to when resuming)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_args(b)
    gb = b.add_argument_group("defaults for lines that do not set them")
    gb.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    gb.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    b.set_defaults(func=cmd_batch)

    v = sub.add_parser("convert", help="convert a checkpoint to jaxkv's format",
                       description="SRC: Hugging Face folder, GGUF file or jaxkv checkpoint.")
    v.add_argument("src")
    v.add_argument("dst")
    v.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="stored weight dtype (default: %(default)s)")
    v.set_defaults(func=cmd_convert)

    e = sub.add_parser("estimate", help="KV cache size, term by term, and what fits a budget",
                       description="KV bytes = 2 x layers x KV heads x head_dim x tokens x batch x "
                                   "bytes per element (+ scales when int8). Give a model (name or "
                                   "path) or explicit --layers/--kv-heads/--head-dim.")
    e.add_argument("--model", default="smollm2-135m-instruct", help="model name or path")
    e.add_argument("--layers", type=int, default=None, help="explicit number of layers")
    e.add_argument("--kv-heads", type=int, default=None, help="explicit number of KV heads")
    e.add_argument("--head-dim", type=int, default=None, help="explicit head dimension")
    e.add_argument("--context", type=int, default=4096, help="tokens per sequence (default: %(default)s)")
    e.add_argument("--batch", type=int, default=1, help="sequences (default: %(default)s)")
    e.add_argument("--kv-dtype", default="bfloat16",
                   choices=["float32", "bfloat16", "float16", "int8"],
                   help="KV element type (default: %(default)s)")
    e.add_argument("--memory", default=None,
                   help="device memory budget (e.g. 24GB, 80GiB): report the largest batch and "
                        "longest context that fit beside the weights")
    e.add_argument("--weight-dtype", default="bfloat16", help="for the weight bytes (default: %(default)s)")
    e.add_argument("--weight-bytes", type=_size, default=None,
                   help="weight bytes to set aside (default: computed from the model)")
    e.add_argument("--page-size", type=int, default=16, help="KV page size (default: %(default)s)")
    e.set_defaults(func=cmd_estimate)

    # Parsed by jaxkv.bench itself (see main); listed here for --help.
    sub.add_parser("bench", help="generation benchmarks, jaxkv vs Hugging Face "
                                 "(jaxkv bench --help)")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own parser: every option passes through
        from jaxkv.bench import main as bench_main
        return bench_main(argv[1:]) or 0
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(a, "verbose", False) else logging.WARNING,
                        format="%(message)s")
    try:
        return a.func(a) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
