"""`jaxkv serve`'s own options (the engine's come from `EngineConfig`):
what the server answers, to whom, and what a client may hold of it."""

from __future__ import annotations

import argparse

from jaxkv.entrypoints.cli_options import parse_size


def add_serve_options(s) -> None:
    """Add the server's options to the `serve` parser `s`."""
    s.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: %(default)s)"
    )
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    s.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        help="name clients pass as `model` (repeatable; default: --model)",
    )
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting for admission before new ones get 429 "
        "(0: no bound; default: %(default)s)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for requests in flight before aborting them "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=16 * 2**20,
        help="largest request body accepted; a larger one is answered 413 (default: %(default)s)",
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="every endpoint but /health needs 'Authorization: Bearer KEY' (401 "
        "otherwise); default: $JAXKV_API_KEY if set, else no key; an empty "
        "key is refused",
    )
    s.add_argument(
        "--allowed-hosts",
        action="append",
        default=None,
        metavar="HOST",
        help="Host header names the server answers (repeatable; '*' for any); "
        "default: the --host address and localhost, any host when --host is "
        "0.0.0.0 or ::",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection may take to send a request's head (408 and "
        "closed after; default: %(default)s)",
    )
    s.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request's body may take to arrive (408 after; default: %(default)s)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at once; more are answered 503 (default: the "
        "open-file limit less a reserve)",
    )
    s.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        default=None,
        help="how tool calls are read from answers (default: by the model's chat "
        "template: llama3_json where it speaks Llama 3's, else hermes)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=("qwen3", "deepseek_r1"),
        default=None,
        help="put the <think>...</think> part of answers in reasoning_content",
    )
    s.add_argument(
        "--enable-kv-map",
        action="store_true",
        help="serve the live KV page map (GET / and /v1/kv_map): it shows every "
        "running request's length and timing to whoever may read it",
    )
    s.add_argument(
        "--enable-runtime-lora-loading",
        action="store_true",
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
        "$JAXKV_ALLOW_RUNTIME_LORA_UPDATING=1); off, they answer 404",
    )
    s.add_argument(
        "--lora-root",
        action="append",
        default=None,
        metavar="DIR",
        help="runtime loading reads adapter folders under this folder only "
        "(repeatable; default: anywhere the server can read)",
    )
    s.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine replicas, each its own process with its own devices (a CPU "
        "core each on a CPU; --tensor-parallel-size GPUs each), scheduler and "
        "page pool; requests go to the replica holding the longest cached "
        "prefix, by load on a tie (default: %(default)s)",
    )
    s.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        help=argparse.SUPPRESS,  # set by the front for each replica it starts
    )
    s.add_argument(
        "--disaggregation-mode",
        choices=("null", "prefill", "decode"),
        default="null",
        help="this server's side of a prefill/decode split, as sglang-router's "
        "--pd-disaggregation drives it: prefill runs prompts and hands their KV "
        "pages over; decode takes them and generates (default: %(default)s, both)",
    )
    s.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=8998,
        help="prefill side: the TCP port decode servers fetch pages from (default: %(default)s)",
    )
    s.add_argument(
        "--disaggregation-transfer-backend",
        choices=("auto", "jax", "tcp"),
        default="auto",
        help="how pages travel: JAX's transfer server (jax.experimental.transfer), or "
        "checksummed frames on the bootstrap socket; auto: JAX's where both sides run "
        "it (default: %(default)s)",
    )
    s.add_argument(
        "--disaggregation-transfer-timeout",
        type=float,
        default=30.0,
        help="seconds a decode server waits for a prompt's pages before the request "
        "ends with an error (default: %(default)s)",
    )
    s.add_argument(
        "--disaggregation-room-timeout",
        type=float,
        default=60.0,
        help="prefill side: seconds a prompt's pages wait to be collected before they "
        "are dropped (default: %(default)s)",
    )
    s.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV events (pages stored in and removed from the prefix cache) "
        "over ZMQ in vLLM's format, for KV-aware routers: vLLM's config object, "
        'e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557"}\'; GET /kv_event_sources says where',
    )


def serve_kwargs(a) -> dict:
    """`jaxkv.entrypoints.openai.server.serve`'s keyword arguments from
    the parsed options."""
    return dict(
        host=a.host,
        port=a.port,
        max_queued_requests=a.max_queued_requests or None,
        shutdown_timeout=a.shutdown_timeout,
        max_request_bytes=a.max_request_bytes,
        api_key=a.api_key,
        allowed_hosts=a.allowed_hosts,
        header_timeout=a.header_timeout,
        body_timeout=a.body_timeout,
        max_connections=a.max_connections,
        enable_kv_map=a.enable_kv_map,
        tool_call_parser=a.tool_call_parser,
        reasoning_parser=a.reasoning_parser,
        enable_runtime_lora_loading=a.enable_runtime_lora_loading,
        lora_roots=a.lora_root,
        kv_events_config=a.kv_events_config,
        model_path=a.model,
        data_parallel_rank=a.data_parallel_rank,
        disaggregation_mode=a.disaggregation_mode,
        disaggregation_bootstrap_host=a.host,
        disaggregation_bootstrap_port=a.disaggregation_bootstrap_port,
        disaggregation_transfer_timeout=a.disaggregation_transfer_timeout,
        disaggregation_room_timeout=a.disaggregation_room_timeout,
        disaggregation_transfer_backend=a.disaggregation_transfer_backend,
        log_level="info" if a.verbose else "warning",
    )
