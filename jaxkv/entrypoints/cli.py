"""The `jaxkv` command.

    jaxkv generate "What is a KV cache?" [--model M] [--max-tokens N] [--stream]
    jaxkv chat [--model M]
    jaxkv batch IN.jsonl OUT.jsonl [--model M]
    jaxkv serve [--model M] [--host 127.0.0.1] [--port 8000]
                [--enable-lora --lora-modules NAME=PATH ...]   (also batch)
    jaxkv convert SRC DST [--dtype bfloat16]
    jaxkv estimate [--model M] [--context N] [--memory 24GB]

Engine and sampling options are the fields of `EngineConfig` and
`SamplingParams` (`jaxkv.entrypoints.cli_options`). Several processes: run
the same command on each with --num-processes N --process-id I
--coordinator-address HOST:PORT --tensor-parallel-size (all devices);
process 0 answers, the others run its steps and exit with it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from checkpoints.known_models import DEFAULT_MODEL
from jaxkv.entrypoints.cli_options import add_lora_modules, add_options, lora_requests, values
from jaxkv.entrypoints.estimate import add_estimate_command
from jaxkv.entrypoints.serve_options import add_serve_options, serve_kwargs

ENGINE, SAMPLING = "engine_", "sampling_"


def _engine_args(p: argparse.ArgumentParser, **defaults) -> None:
    from jaxkv.config import EngineConfig

    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model name (smollm2-135m-instruct, fetched and converted once into "
        "$JAXKV_CACHE, default ~/.cache/jaxkv) or a path: Hugging Face folder, "
        "GGUF file or jaxkv checkpoint (default: %(default)s)",
    )
    add_options(g, EngineConfig, prefix=ENGINE, defaults=defaults, rename={"seed": "engine-seed"})
    g.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="speculative decoding with this draft model (same vocabulary): "
        'short for --speculative-config \'{"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": 4}\'',
    )
    g.add_argument("-v", "--verbose", action="store_true", help="log engine set-up")


def _sampling_args(p: argparse.ArgumentParser, title: str = "sampling", **defaults) -> None:
    from jaxkv.core.sampling_params import SamplingParams

    g = p.add_argument_group(title)
    add_options(
        g,
        SamplingParams,
        prefix=SAMPLING,
        defaults={"max_tokens": 128, "temperature": 0.0, **defaults},
    )


def _make_engine(a):
    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine

    kw = values(a, EngineConfig, prefix=ENGINE)
    if getattr(a, "draft_model", None):
        if kw.get("speculative_config") is not None:
            raise ValueError("--draft-model: give it or --speculative-config, not both")
        kw["speculative_config"] = {
            "method": "draft_model",
            "model": a.draft_model,
            "num_speculative_tokens": 4,
        }
    loras = lora_requests(getattr(a, "lora_modules", None))
    if loras and not kw.get("enable_lora"):
        raise ValueError("--lora-modules: LoRA is off; add --enable-lora")
    if (
        getattr(a, "disaggregation_mode", "null") == "decode"
        and kw.get("kv_offload_memory") is None
    ):
        kw["kv_offload_memory"] = 512 * 2**20  # where the prefill server's pages land
    engine = LLMEngine.from_pretrained(a.model, **kw)
    if engine.follow():  # process 1..n-1 of a multi-process job: it ran process 0's steps
        raise SystemExit(0)
    for r in loras:  # read and checked now: a bad one stops the start, named
        try:
            engine.loras.resolve(r)
        except ValueError as e:
            raise ValueError(f"--lora-modules {r.lora_name}={r.lora_path}: {e}") from None
    return engine


def _params(a):
    from jaxkv.core.sampling_params import SamplingParams

    return SamplingParams(**values(a, SamplingParams, prefix=SAMPLING))


def _stream(engine, prompt, params, raw: bool) -> str:
    """Generate one answer, printing text as it arrives; returns the text."""
    if params.n != 1:
        raise ValueError("n: streaming (--stream, chat) shows one answer; leave n at 1")
    rid = engine.add_request(prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            if o.error:
                raise ValueError(o.error)  # main prints it and exits 2, like every bad option
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
    if a.engine_kv_cache_memory is None and a.engine_num_pages is None:
        # One request: the default KV pool (jaxkv.model.memory) holds its n
        # sequences of at most prompt bytes + 256 (chat template) + max_tokens.
        a.engine_max_num_seqs = min(a.engine_max_num_seqs, a.sampling_n)
        a.engine_max_model_len = a.engine_max_model_len or (
            len(a.prompt.encode()) + 256 + a.sampling_max_tokens
        )
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
    if len(out.outputs) == 1:
        print(out.outputs[0].text)
    for c in out.outputs[1:] and out.outputs:
        print(f"--- answer {c.index + 1} of {len(out.outputs)} ---\n{c.text}")
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
    from jaxkv.core.sampling_params import SamplingParams
    from jaxkv.entrypoints.batch import run_batch

    engine = _make_engine(a)
    defaults = {
        k: v for k, v in values(a, SamplingParams, prefix=SAMPLING).items() if v is not None
    }
    counts = run_batch(
        engine, a.input, a.output, defaults=defaults, progress=not a.quiet, model_names=[a.model]
    )
    print(
        f"wrote {counts['written']} records ({counts['errors']} errors), "
        f"skipped {counts['skipped']} already done",
        file=sys.stderr,
    )
    return 0


def cmd_serve(a) -> int:
    from jaxkv.entrypoints.openai.guard import check_api_key
    from jaxkv.entrypoints.openai.server import serve

    try:
        check_api_key(a.api_key)  # before minutes of loading
    except ValueError as e:
        raise ValueError(f"--api-key: {str(e).split(': ', 1)[1]}") from None
    names = a.served_model_name or [a.model]
    if a.data_parallel_size > 1:
        if a.disaggregation_mode != "null":
            raise ValueError(
                "--data-parallel-size: not with --disaggregation-mode yet; run one "
                "prefill and one decode server per replica behind the router"
            )
        return _serve_data_parallel(a, names)
    engine = _make_engine(a)
    return serve(engine, names, **serve_kwargs(a))


def _serve_data_parallel(a, names) -> int:
    from jaxkv.config import EngineConfig
    from jaxkv.entrypoints.openai.dp_app import serve_dp
    from jaxkv.entrypoints.openai.dp_replicas import Replicas
    from jaxkv.entrypoints.openai.kv_events import parse_config

    kw = values(a, EngineConfig, prefix=ENGINE)
    replicas = Replicas(
        a.argv[1:],
        a.data_parallel_size,
        tp=kw.get("tensor_parallel_size") or 1,
        page_size=kw.get("page_size") or EngineConfig().page_size,
        events_cfg=parse_config(a.kv_events_config),
    )
    return serve_dp(
        replicas,
        names,
        host=a.host,
        port=a.port,
        shutdown_timeout=a.shutdown_timeout,
        api_key=a.api_key,
        allowed_hosts=a.allowed_hosts,
        header_timeout=a.header_timeout,
        max_connections=a.max_connections,
        max_request_bytes=a.max_request_bytes,
        body_timeout=a.body_timeout,
        log_level="info" if a.verbose else "warning",
    )


def cmd_convert(a) -> int:
    from checkpoints.convert import convert

    convert(a.src, a.dst, a.dtype, verify_checksums=a.verify_checksums)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxkv", description="LLM inference in JAX on a paged KV cache."
    )
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser(
        "generate",
        help="answer one prompt",
        description="Answer one prompt (with the model's chat template unless --raw).",
    )
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without chat template"
    )
    _engine_args(g, warmup=False)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat with the chat template")
    c.add_argument("--system", default=None, help="system message")
    _engine_args(c, warmup=False)
    _sampling_args(c, max_tokens=512)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser(
        "batch",
        help="generate for a JSONL file, resumable",
        description='Each input line: {"prompt": ...} or {"messages": [...]} plus '
        'optional SamplingParams fields and "model" (a LoRA '
        "adapter of --lora-modules). Output: one JSON record per "
        "input line, in order; re-running resumes.",
    )
    b.add_argument("input", help="input JSONL")
    b.add_argument("output", help="output JSONL (appended to when resuming)")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_args(b)
    add_lora_modules(b)
    _sampling_args(b, "sampling, for lines that do not set it")
    b.set_defaults(func=cmd_batch)

    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server",
        description="POST /v1/completions, /v1/chat/completions (stream: SSE), "
        "/v1/responses, /tokenize, /detokenize, with --enable-lora "
        "/v1/load_lora_adapter, /v1/unload_lora_adapter; GET "
        "/v1/models, /health, /metrics.",
    )
    add_serve_options(s)
    _engine_args(s)
    add_lora_modules(s)
    s.set_defaults(func=cmd_serve)

    v = sub.add_parser(
        "convert",
        help="convert a checkpoint to jaxkv's format",
        description="SRC: Hugging Face folder, GGUF file or jaxkv checkpoint.",
    )
    v.add_argument("src")
    v.add_argument("dst")
    v.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="stored weight dtype (default: %(default)s)",
    )
    v.add_argument(
        "--no-verify-checksums",
        dest="verify_checksums",
        action="store_false",
        help="do not check a jaxkv SRC's tensor checksums (faster)",
    )
    v.set_defaults(func=cmd_convert)

    add_estimate_command(sub)
    from jaxkv.training.train_draft import add_command as add_train_draft

    add_train_draft(sub)

    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = build_parser().parse_args(argv)
    a.argv = argv
    logging.basicConfig(
        level=logging.INFO if getattr(a, "verbose", False) else logging.WARNING,
        format="%(message)s",
    )
    if a.command in ("generate", "chat", "batch", "serve"):
        from jaxkv.config import EngineConfig
        from jaxkv.paths import enable_compilation_cache, uses_program_store

        if not uses_program_store(values(a, EngineConfig, prefix=ENGINE)):
            enable_compilation_cache()
    try:
        return a.func(a) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The `jaxkv` program: `main`, then the process ends at once. The exit
    handlers run (`atexit`) and the streams are flushed, but the
    interpreter's teardown (freeing every module and the XLA client one by
    one: half a second of a 4-second `jaxkv generate`) is skipped; the
    operating system frees it all. Tests call `main`, which returns."""
    import atexit
    import os

    rc = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe: nothing more to say
        pass
    atexit._run_exitfuncs()  # noqa: SLF001 - what a normal exit runs first
    logging.shutdown()
    os._exit(rc if isinstance(rc, int) else 1)


if __name__ == "__main__":
    run()
