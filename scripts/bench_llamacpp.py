"""The llama.cpp peer of `scripts/bench.py` (`--peer llamacpp`):
llama-cpp-python on the same GGUF file, in the same process, greedy, with
as many threads as the machine has cores. Optional: llama-cpp-python is
never a dependency (`pip install llama-cpp-python`, which builds llama.cpp
from source; on Xeon VMs with AMX add
`CMAKE_ARGS="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"`).

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


class LlamaCppBench:
    name = "llamacpp"

    def __init__(self, model: str, cores: int, n_ctx: int = 8192):
        try:
            import llama_cpp
        except ImportError as e:
            raise SystemExit("--peer llamacpp needs llama-cpp-python (pip install "
                             "llama-cpp-python; it builds llama.cpp from source)") from e
        from bench_jaxkv import jaxkv_model_source

        path = Path(jaxkv_model_source(model)).expanduser()
        if not (path.is_file() and path.suffix == ".gguf"):
            raise SystemExit(f"--peer llamacpp: {model!r} is not a GGUF file")
        t = time.perf_counter()
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=cores,
                                   n_threads_batch=cores, n_batch=512, verbose=False)
        self.load_s = time.perf_counter() - t
        self.n_vocab = self.llm.n_vocab()
        self.versions = dict(llama_cpp_python=llama_cpp.__version__, threads=cores,
                             gguf=path.name)

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

    def decode_setup(self, prompts: list[list[int]]) -> dict[str, Any] | None:
        return dict(prompt=prompts[0]) if len(prompts) == 1 else None

    def decode_run(self, state: dict[str, Any], steps: int) -> float:
        self.llm.reset()
        self.llm.eval(state["prompt"])
        tok = self._next()
        t = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([tok])
            tok = self._next()
        return time.perf_counter() - t
