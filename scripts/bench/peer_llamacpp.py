"""The llama.cpp peer of `scripts/bench/generation.py` (`--peer llamacpp`):
llama-cpp-python on the same GGUF file, in the same process, greedy, with
as many threads as the machine has cores. Optional: llama-cpp-python is
never a dependency (`pip install llama-cpp-python`, which builds llama.cpp
from source; on Xeon VMs with AMX add
`CMAKE_ARGS="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"`).

llama.cpp runs in a child process of its own (spawned; the parent sends
each call and the child times it): in the benchmark's process, after the
jaxkv engine's OpenMP kernels had run, llama.cpp's batch-1 decode fell
from ~83 to ~30 tok/s for the rest of the process on the 2-core Xeon (both
use the system libgomp), which would measure the process, not llama.cpp.

Same interface as `bench_hf.HFBench`: `prefill(prompt)` (seconds from the
prompt to its first greedy token, llama.cpp's own 512-token batches),
`decode_setup(prompts)` (batch 1 only: llama-cpp-python's high-level API
decodes one sequence; None at other batches) and `decode_run(state, steps)`
(seconds for `steps` greedy tokens after the prefilled prompt)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np


class _Model:
    """llama.cpp itself, in the child process."""

    def __init__(self, path: str, cores: int, n_ctx: int):
        import llama_cpp

        t = time.perf_counter()
        self.llm = llama_cpp.Llama(
            model_path=path,
            n_ctx=n_ctx,
            n_threads=cores,
            n_threads_batch=cores,
            n_batch=512,
            verbose=False,
        )
        self.load_s = time.perf_counter() - t
        self.n_vocab = self.llm.n_vocab()
        self.version = llama_cpp.__version__

    def _next(self) -> int:
        """The greedy token after what was evaluated (the last row's logits)."""
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(logits.argmax())

    def prefill(self, prompt: list[int]) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(prompt)
        self._next()
        return time.perf_counter() - t

    def decode_run(self, prompt: list[int], steps: int) -> float:
        self.llm.reset()
        self.llm.eval(prompt)
        tok = self._next()
        t = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([tok])
            tok = self._next()
        return time.perf_counter() - t


def _serve(conn, path: str, cores: int, n_ctx: int) -> None:
    """The child: load, report, then answer (method, args) until None."""
    try:
        m = _Model(path, cores, n_ctx)
        conn.send(("ok", dict(load_s=m.load_s, version=m.version)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent exited without sending None
            return
        if msg is None:
            return
        conn.send(getattr(m, msg[0])(*msg[1]))


class LlamaCppBench:
    name = "llamacpp"

    def __init__(self, model: str, cores: int, n_ctx: int = 8192):
        import importlib.util
        import multiprocessing as mp

        if importlib.util.find_spec("llama_cpp") is None:
            raise SystemExit(
                "--peer llamacpp needs llama-cpp-python (pip install "
                "llama-cpp-python; it builds llama.cpp from source)"
            )
        from scripts.bench.peer_jaxkv import jaxkv_model_source

        path = Path(jaxkv_model_source(model)).expanduser()
        if not (path.is_file() and path.suffix == ".gguf"):
            raise SystemExit(f"--peer llamacpp: {model!r} is not a GGUF file")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(path), cores, n_ctx), daemon=True)
        self._proc.start()
        status, info = self._conn.recv()
        if status != "ok":
            raise SystemExit(f"--peer llamacpp: {info}")
        self.load_s = info["load_s"]
        self.versions = dict(
            llama_cpp_python=info["version"],
            threads=cores,
            gguf=path.name,
            process="own child process",
        )

    def _call(self, method: str, *args) -> float:
        self._conn.send((method, args))
        return self._conn.recv()

    def prefill(self, prompt: list[int]) -> float:
        """Seconds from the prompt to its first greedy token."""
        return self._call("prefill", list(prompt))

    def decode_setup(self, prompts: list[list[int]]) -> dict[str, Any] | None:
        return dict(prompt=list(prompts[0])) if len(prompts) == 1 else None

    def decode_run(self, state: dict[str, Any], steps: int) -> float:
        """Seconds for `steps` greedy tokens after the prefilled prompt."""
        return self._call("decode_run", state["prompt"], steps)

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(None)
            self._proc.join(10)
