"""jaxkv on Ray Serve, for replicas over many machines (`pip install
"jaxkv[ray]"`).

Two deployments:

- `JaxkvEngine`, `num_replicas` of them (or an `autoscaling_config`): each
  replica loads its own engine on its own devices (Ray gives each actor its
  GPUs; on a CPU, `ray_actor_options` says how many cores) and serves it
  with jaxkv's own server on 127.0.0.1 inside the actor, so every route,
  check and stream is the one `jaxkv serve` has.
- `JaxkvIngress`: the OpenAI routes behind Serve's HTTP proxy; it reads
  the body and passes the request on through a deployment handle, streaming
  the answer back.

Requests reach engine replicas through `PrefixAffinityRouter`, Serve's
custom request router: the first 256 characters of a request's
conversation (or prompt) pick a replica by rendezvous hashing, so a chat's
turns and requests sharing a system prompt land where their pages are
cached; a replica with more than twice the least loaded one's queue (plus
4) gives way, and Serve's own choice among the rest (the shortest queue)
decides. A request without a prompt goes by queue length.

    serve run jaxkv.entrypoints.ray_serve:app_builder model=smollm2-135m-instruct num_replicas=2

or from Python: `serve.run(build_app("smollm2-135m-instruct", num_replicas=2))`.
Tensor parallel across hosts stays on `jax.distributed` (see the docs).
"""

import hashlib
import json
import os
import socket
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.request_router import FIFOMixin, RequestRouter

PASS = {"content-type", "accept", "authorization", "x-request-id"}
BACK = {"content-type", "cache-control", "x-request-id", "x-jaxkv-replica"}
KEY_CHARS = 256


def prefix_key(args) -> bytes | None:
    """What a request's prefix affinity hashes: the start of its messages or
    prompt (args: `JaxkvEngine.handle`'s)."""
    try:
        body = json.loads(args[4])
    except (IndexError, TypeError, ValueError):
        return None
    if not isinstance(body, dict):
        return None
    text = body.get("messages") or body.get("prompt") or body.get("input")
    if not text:
        return None
    return json.dumps(text, sort_keys=True)[:KEY_CHARS].encode()


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Ranks the replica a request's prefix hashes to first (see the module)."""

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        key = prefix_key(pending_request.args) if pending_request is not None else None
        if key is None or len(candidate_replicas) < 2:
            return [candidate_replicas]

        def weight(r):
            return hashlib.blake2b(key + str(r.replica_id).encode(), digest_size=8).digest()

        ranked = sorted(candidate_replicas, key=weight, reverse=True)
        lens = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) for r in ranked}
        known = [v for v in lens.values() if v is not None]
        first = lens[ranked[0].replica_id]
        if known and first is not None and first > 2 * min(known) + 4:
            return [ranked[1:], ranked[:1]]
        return [ranked[:1], ranked[1:]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@serve.deployment(request_router_config={"request_router_class": PrefixAffinityRouter})
class JaxkvEngine:
    def __init__(self, model: str, engine_options: dict, served: list[str]):
        import httpx
        import uvicorn

        from jaxkv.core.engine import LLMEngine
        from jaxkv.entrypoints.openai.connections import uvicorn_config
        from jaxkv.entrypoints.openai.server import build_app

        engine = LLMEngine.from_pretrained(model, **engine_options)
        app = build_app(engine, served, model_path=model)
        self.port = _free_port()
        self.server = uvicorn.Server(
            uvicorn_config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("jaxkv: the replica's server did not start")
            time.sleep(0.05)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def check_health(self) -> None:
        if not self.thread.is_alive() or not self.server.started:
            raise RuntimeError("jaxkv: the replica's server stopped")

    async def handle(self, method: str, path: str, query: str, headers: dict, body: bytes):
        """The request, answered by this replica's server: first a dict of
        status and headers, then the body's chunks as they come."""
        url = f"http://127.0.0.1:{self.port}{path}" + (f"?{query}" if query else "")
        req = self.client.build_request(method, url, content=body, headers=headers)
        resp = await self.client.send(req, stream=True)
        try:
            back = {k: v for k, v in resp.headers.items() if k.lower() in BACK}
            yield {"status": resp.status_code, "headers": {**back, "x-jaxkv-replica": self.name}}
            async for chunk in resp.aiter_raw():
                yield chunk
        finally:
            await resp.aclose()


def _ingress_class():
    # No `from __future__ import annotations` in this module: Ray ships the
    # class to its replicas by value, and a string annotation would not find
    # `Request` there, so FastAPI would read it as a query parameter.
    api = FastAPI(title="jaxkv (Ray Serve)")

    @serve.deployment
    @serve.ingress(api)
    class JaxkvIngress:
        def __init__(self, engine):
            self.engine = engine.options(stream=True, method_name="handle")

        @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
        async def route(self, path: str, request: Request):
            headers = {k: v for k, v in request.headers.items() if k.lower() in PASS}
            gen = self.engine.remote(
                request.method, "/" + path, request.url.query, headers, await request.body()
            )
            head = await gen.__anext__()

            async def rest():
                async for chunk in gen:
                    yield chunk

            return StreamingResponse(rest(), status_code=head["status"], headers=head["headers"])

    return JaxkvIngress


def build_app(
    model: str,
    *,
    num_replicas: int | None = 2,
    autoscaling_config: dict | None = None,
    engine_options: dict | None = None,
    served_model_name: str | None = None,
    ray_actor_options: dict | None = None,
):
    """The Serve application: `num_replicas` engines (or `autoscaling_config`,
    Serve's own) behind the ingress. `engine_options`: `EngineConfig`'s
    fields; `ray_actor_options`: each engine's resources (e.g. {"num_gpus": 1})."""
    opts: dict = {"ray_actor_options": ray_actor_options or {"num_cpus": 1}}
    if autoscaling_config is not None:
        opts["autoscaling_config"] = autoscaling_config
    else:
        opts["num_replicas"] = num_replicas
    engine = JaxkvEngine.options(**opts).bind(
        model, dict(engine_options or {}), [served_model_name or model]
    )
    return _ingress_class().options(ray_actor_options={"num_cpus": 0}).bind(engine)


def app_builder(args: dict):
    """For `serve run jaxkv.entrypoints.ray_serve:app_builder model=M
    num_replicas=N [served_model_name=NAME] [engine_options=JSON]`."""
    engine_options = args.get("engine_options")
    return build_app(
        args.get("model", "smollm2-135m-instruct"),
        num_replicas=int(args.get("num_replicas", 2)),
        engine_options=json.loads(engine_options) if engine_options else None,
        served_model_name=args.get("served_model_name"),
    )
