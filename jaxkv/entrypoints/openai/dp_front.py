"""The front of `jaxkv serve --data-parallel-size N`: one HTTP server that
owns no engine and hands each request to a replica (`dp_replicas`).

- Generation (`/v1/completions`, `/v1/chat/completions`, `/v1/responses`):
  the prompt is rendered by a replica (`/…/render`: the exact ids, every
  check a real request passes; a bad body gets that replica's 400 as is),
  hashed page by page as the pools name pages, and sent to the replica
  holding the longest run of them (`Replicas.pick`). `X-data-parallel-rank`
  picks the replica instead. A Responses request that continues
  `previous_response_id` goes where that response is stored.
- The answer streams back as the replica writes it, with
  `X-data-parallel-rank` saying who answered. A client that leaves closes
  the replica's connection, which aborts the request there.
- A replica that dies: its requests in flight end with a named error (a 503
  before the answer started, an `error` event in a stream), the others
  carry on, and the replica is started again.
- `/metrics` joins the replicas' with an `engine="i"` label on each series;
  `/get_load`, `/flush_cache`, `/health_generate`, LoRA loading, stored
  responses and `/kv_event_sources` cover every replica.
"""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxkv.entrypoints.openai.dp_replicas import NoReplica, Replica, Replicas
from jaxkv.entrypoints.openai.router_routes import check_rank_header

PASS_HEADERS = {"content-type", "accept", "x-request-id", "user-agent"}
BACK_HEADERS = {"content-type", "cache-control", "x-request-id"}
GENERATE = {
    "/v1/completions": "/v1/completions/render",
    "/v1/chat/completions": "/v1/chat/completions/render",
    "/v1/responses": None,
}
BROADCAST = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/flush_cache"}


class FrontErrors:
    """What the `Guard` counts (refused requests), shown in /metrics."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    def error(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1


def _error(message: str, status: int, type_: str = "ServiceUnavailable") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": None, "code": status}},
        status_code=status,
    )


class Front:
    def __init__(self, replicas: Replicas, served: list[str]):
        self.r = replicas
        self.served = served
        self.accepting = True

    def auth(self) -> dict:
        return {"authorization": f"Bearer {self.r.key}"}

    async def call(self, rep: Replica, method: str, path: str, body=None) -> httpx.Response:
        try:
            return await self.r.client.request(
                method, rep.url + path, content=body, headers=self.auth(), timeout=60.0
            )
        except httpx.ConnectError:
            rep.healthy = False  # it just died; `watch` starts it again
            raise

    async def call_any(self, method: str, path: str, body=None) -> httpx.Response:
        """`call` on the least loaded replica, the next one if it just died."""
        for _ in range(self.r.n):
            try:
                return await self.call(self.r.least_loaded(), method, path, body)
            except httpx.ConnectError:
                continue
        raise NoReplica("no data-parallel replica answered; retry")

    async def everyone(self, method: str, path: str, body=None) -> list:
        """(replica, response or the error) from every healthy replica."""
        reps = self.r.healthy()
        got = await asyncio.gather(
            *(self.call(x, method, path, body) for x in reps), return_exceptions=True
        )
        return list(zip(reps, got))

    async def broadcast(self, path: str, body: bytes) -> Response:
        """POST to every replica (LoRA loading, cache flush): the first
        refusal is the answer, else their answers with the counts summed."""
        got = await self.everyone("POST", path, body)
        if len(got) < self.r.n:
            return _error("a data-parallel replica is restarting; retry", 503)
        merged: dict = {}
        for rep, g in got:
            if not isinstance(g, httpx.Response):
                return _error(f"data-parallel replica {rep.rank} failed ({type(g).__name__})", 503)
            if g.status_code != 200:
                return Response(
                    g.content, status_code=g.status_code, media_type=g.headers.get("content-type")
                )
            for k, v in (g.json() if g.content else {}).items():
                summed = isinstance(v, int) and not isinstance(v, bool)
                merged[k] = merged.get(k, 0) + v if summed else v
        return JSONResponse(merged)

    def num_in_flight(self) -> int:
        return sum(r.in_flight for r in self.r.replicas)

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new generation requests (the replicas drain their own when
        they are stopped)."""
        self.accepting = False

    async def forward(
        self, rep: Replica, request: Request, body: bytes, path: str, pinned: bool = False
    ) -> Response:
        """Send the request to `rep` and stream its answer back. A replica
        that refuses the connection (it just died: nothing was sent) is
        marked down and, unless `pinned`, the least loaded other takes it."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in PASS_HEADERS}
        query = f"?{request.url.query}" if request.url.query else ""
        for _ in range(self.r.n):
            rep.in_flight += 1
            try:
                req = self.r.client.build_request(
                    request.method,
                    rep.url + path + query,
                    content=body,
                    headers={**headers, **self.auth()},
                )
                resp = await self.r.client.send(req, stream=True)
                break
            except httpx.ConnectError:
                rep.in_flight -= 1
                rep.healthy = False
                if pinned:
                    return _error(f"data-parallel replica {rep.rank} is restarting; retry", 503)
                rep = self.r.least_loaded()
            except httpx.HTTPError as e:
                rep.in_flight -= 1
                return _error(
                    f"data-parallel replica {rep.rank} failed before answering "
                    f"({type(e).__name__}); retry",
                    503,
                )
        else:
            return _error("no data-parallel replica answered; retry", 503)
        sse = resp.headers.get("content-type", "").startswith("text/event-stream")

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as e:
                msg = (
                    f"data-parallel replica {rep.rank} stopped mid-answer "
                    f"({type(e).__name__}); the request ended"
                )
                if sse:
                    err = {"error": {"message": msg, "type": "ReplicaFailed", "code": 503}}
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
            finally:
                rep.in_flight -= 1
                await resp.aclose()

        back = {k: v for k, v in resp.headers.items() if k.lower() in BACK_HEADERS}
        back["x-data-parallel-rank"] = str(rep.rank)
        return StreamingResponse(relay(), status_code=resp.status_code, headers=back)

    async def route(self, request: Request, path: str, body: bytes) -> Response:
        """The replica for a generation request (see the module's text)."""
        rank = check_rank_header(request, self.r.n)
        if rank is not None:
            rep = self.r.replicas[rank]
            if not rep.healthy:
                return _error(f"data-parallel replica {rank} is restarting; retry", 503)
            return await self.forward(rep, request, body, path, pinned=True)
        try:
            parsed = await asyncio.to_thread(json.loads, body)
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):  # the replica's own 400
            return await self.forward(self.r.least_loaded(), request, body, path)
        if path == "/v1/responses":
            prev = parsed.get("previous_response_id")
            if isinstance(prev, str):
                for rep, got in await self.everyone("GET", f"/v1/responses/{prev}"):
                    if isinstance(got, httpx.Response) and got.status_code == 200:
                        return await self.forward(rep, request, body, path)
            return await self.forward(self.r.least_loaded(), request, body, path)
        ids = None
        if parsed.get("model") in (None, *self.served):  # an adapter's pages differ: by load
            rendered = await self.call_any("POST", GENERATE[path], body)
            if rendered.status_code != 200:
                return Response(
                    rendered.content,
                    status_code=rendered.status_code,
                    media_type="application/json",
                )
            ids = rendered.json()["requests"][0]["prompt_token_ids"]
        salt = parsed.get("cache_salt")
        hashes = self.r.page_hashes(ids, salt if isinstance(salt, str) else None) if ids else []
        rep, _ = self.r.pick(hashes)
        return await self.forward(rep, request, body, path)
