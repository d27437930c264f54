"""One engine, one thread: the server's handlers never touch the LLMEngine.

Handlers call `submit` (from the event loop) and read the request's outputs
from an asyncio queue; `abort` asks for a request to stop. Both only put a
command on a thread-safe queue. The engine thread applies the commands
between steps, steps while there is work, and hands every output back to
the event loop with `call_soon_threadsafe`.

A step that raises fails the requests it was running with an error, never
the server: the loop aborts them, delivers an "error" output to each and
goes on with the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid

from jaxkv.core.outputs import CompletionOutput, RequestOutput
from jaxkv.entrypoints.openai.metrics import request_counts

log = logging.getLogger("jaxkv.serve")


class QueueFull(RuntimeError):
    """More requests wait for admission than the server's bound allows."""


class ShuttingDown(RuntimeError):
    """The server stopped accepting requests."""


@dataclasses.dataclass
class RequestStream:
    """Where a request's outputs arrive (`queue` holds (index, output) pairs,
    so several requests of one HTTP call may share it)."""

    request_id: str
    index: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    t_arrival: float
    n: int = 1  # answers (sequences)
    last: RequestOutput | None = None  # engine thread: the latest output
    t_first: float | None = None  # engine thread: when the first token of any answer came
    t_last: dict = dataclasses.field(default_factory=dict)  # answer -> its latest token's time
    prompt_counted: bool = False

    def put(self, out: RequestOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, out))


class EngineLoop:
    def __init__(self, engine, metrics, *, max_queued_requests: int | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._pending = 0  # submitted, not yet handed to the engine
        self._waiting = 0  # requests in the scheduler's waiting queue after the last step
        self._running = 0  # requests running after the last step
        self._kv_tokens = 0  # KV slots held by requests after the last step
        self.publisher = None  # a kv_events.Publisher: the pool's events go to it
        self._multi = 0  # requests of n > 1 in self._streams (engine thread only)
        self._lock = threading.Lock()
        self._deadline: float | None = None  # abort what is left after this (shutdown)
        self.accepting = True
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)

    # ------------------------------------------------------------ handler side

    def start(self) -> None:
        if self.publisher is not None:
            self.engine.bm.events = []
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self,
        prompt,
        params,
        *,
        out: asyncio.Queue,
        index: int = 0,
        cache_salt: str | None = None,
        lora_request=None,
    ) -> RequestStream:
        """Queue a request (checked already by the caller); its outputs go to
        `out` as (index, RequestOutput). `lora_request`: a LoRA adapter's
        name (or LoRARequest). Raises QueueFull or ShuttingDown."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down and accepts no new requests")
        with self._lock:
            queued = self._pending + self._waiting
            if self.max_queued_requests is not None and queued >= self.max_queued_requests:
                raise QueueFull(
                    f"{queued} requests are waiting, the server's bound "
                    f"(--max-queued-requests) is {self.max_queued_requests}; "
                    "retry later"
                )
            self._pending += 1
        stream = RequestStream(
            f"req-{uuid.uuid4().hex}", index, out, asyncio.get_running_loop(), time.perf_counter()
        )
        self._cmds.put(("add", stream, prompt, params, cache_salt, lora_request))
        return stream

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    async def call(self, fn):
        """fn(engine), run by the engine thread between two steps."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(("call", fn, loop, fut))
        return await fut

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests; abort whatever still runs after `timeout` s."""
        self.accepting = False
        self._cmds.put(("deadline", time.monotonic() + timeout))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and end the engine thread."""
        self.accepting = False
        self._cmds.put(("stop",))
        self._thread.join(timeout)

    def num_in_flight(self) -> int:
        return len(self._streams) + self._pending

    def counts(self) -> tuple[int, int, int]:
        """(running, waiting) requests and the KV token slots they hold: as
        after the last step, with the requests submitted since counted as
        waiting."""
        with self._lock:
            return self._running, self._waiting + self._pending, self._kv_tokens

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        eng = self.engine
        while True:
            busy = eng.has_unfinished_requests()
            try:
                cmd = self._cmds.get_nowait() if busy else self._cmds.get(timeout=0.25)
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    self._fail_all("abort", None)
                    eng.shutdown()  # a disk tier keeps the prefix cache for the next start
                    return
                self._apply(cmd)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._deadline is not None and time.monotonic() > self._deadline and self._streams:
                log.warning(
                    "jaxkv serve: shutdown timeout, aborting %d requests", len(self._streams)
                )
                for rid in list(self._streams):
                    eng.abort(rid)
            if not eng.has_unfinished_requests():
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - a failed step must not end the server
                log.exception("jaxkv serve: engine step failed")
                self.metrics.error("engine_error")
                self._fail_all(
                    "error",
                    f"engine: the step running this request failed ({type(e).__name__}: {e})",
                )
                continue
            self._deliver(outs)

    def _apply(self, cmd) -> None:
        if cmd[0] == "add":
            _, stream, prompt, params, salt, lora = cmd
            with self._lock:
                self._pending -= 1
            self._streams[stream.request_id] = stream
            try:
                self.engine.add_request(
                    prompt, params, request_id=stream.request_id, cache_salt=salt, lora_request=lora
                )
                stream.n = params.n
                self._multi += stream.n > 1
            except Exception as e:  # noqa: BLE001 - the request's error, not the server's
                self._streams.pop(stream.request_id)
                stream.put(_error_output(stream, f"request: {e}"))
            self._count()
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
        elif cmd[0] == "deadline":
            self._deadline = cmd[1]
        elif cmd[0] == "call":
            _, fn, loop, fut = cmd
            try:
                res, err = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - the caller's error
                res, err = None, e
            loop.call_soon_threadsafe(
                lambda: fut.done() or (fut.set_exception(err) if err else fut.set_result(res))
            )
            self._count()

    def _deliver(self, outs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        m = self.metrics
        for o in outs:
            st = self._streams.get(o.request_id)
            if st is None:
                continue
            new = sum(len(c.delta_token_ids) for c in o.outputs)  # every answer's
            if not st.prompt_counted and (new or o.finished) and o.error is None:
                m.prompt_tokens.inc(len(o.prompt_token_ids))
                st.prompt_counted = True
            if new:
                m.generation_tokens.inc(new)
                if st.t_first is None:
                    m.ttft.observe(now - st.t_arrival)
                    st.t_first = now
                for c in o.outputs:
                    _observe_itl(m, st, c.index, len(c.delta_token_ids), now)
            st.last = o
            st.put(o)
            if o.finished:
                del self._streams[o.request_id]
                self._multi -= st.n > 1
                m.e2e.observe(now - st.t_arrival)
                reason = o.outputs[0].finish_reason
                if reason == "error":
                    m.error(
                        "invalid_request"
                        if o.error and not o.outputs[0].token_ids
                        else "engine_error"
                    )
                else:
                    m.finished(reason)
        self._count()

    def _count(self) -> None:
        """Refresh the gauges and the waiting count the queue bound reads."""
        counts = request_counts(self.engine.scheduler, exact=self._multi > 0)
        self.metrics.refresh(self.engine, counts)
        bm = self.engine.bm
        with self._lock:
            self._running, self._waiting = counts
            self._kv_tokens = bm.num_used_pages * bm.page_size
        events = self.engine.bm.events
        if events:
            self.publisher.publish(list(events))
            events.clear()

    def _fail_all(self, reason: str, error: str | None) -> None:
        """End every request in flight with `reason` (the engine's state for
        them is dropped)."""
        eng = self.engine
        for rid, st in list(self._streams.items()):
            try:
                eng.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("jaxkv serve: abort of %s failed", rid)
            st.put(_error_output(st, error, reason))
        self._streams.clear()
        self._multi = 0
        try:  # flush the aborted requests' outputs out of the engine
            while eng.has_unfinished_requests() and not eng.scheduler.has_unfinished():
                eng.step()
        except Exception:  # noqa: BLE001
            log.exception("jaxkv serve: engine flush failed")
        self._count()


def _observe_itl(m, st: RequestStream, answer: int, new: int, now: float) -> None:
    """One inter-token gap per token of `answer` after its first; tokens
    that came in one step share the step's gap."""
    if not new:
        return
    prev = st.t_last.get(answer)
    st.t_last[answer] = now
    if prev is None:  # the answer's first token: no gap before it
        new -= 1
        prev = now
    for _ in range(new):
        m.itl.observe((now - prev) / max(new, 1))


def _error_output(st: RequestStream, error: str | None, reason: str = "error") -> RequestOutput:
    last = st.last
    comp = CompletionOutput(
        index=0,
        text=last.outputs[0].text if last else "",
        token_ids=list(last.outputs[0].token_ids) if last else [],
        finish_reason=reason,
    )
    return RequestOutput(
        request_id=st.request_id,
        prompt=None,
        prompt_token_ids=list(last.prompt_token_ids) if last else [],
        outputs=[comp],
        finished=True,
        error=error,
    )
