"""The Hugging Face transformers peer of `jaxkv bench`: torch on CPU, float32,
on the same GGUF weights, timed the same way as jaxkv (see jaxkv.bench)."""

from __future__ import annotations

import copy
import inspect
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2-135m-instruct"


class HFBench:
    """Hugging Face transformers, torch on CPU, float32, on the same weights.

    Thread count: torch's OpenMP regions stall when another process holds a
    core (a 2-thread decode step can take 4x a 1-thread one on a busy
    2-core machine), so decode and prefill each use whichever of {all
    cores, 1} a short trial found faster: the peer gets its best setting."""

    def __init__(self, model: str, cores: int):
        import torch
        import transformers as tf

        self.torch = torch
        torch.set_num_threads(cores)
        src = _hf_source(model)
        t = time.perf_counter()
        kw = dict(gguf_file=src[1]) if src[1] else {}
        self.model = tf.AutoModelForCausalLM.from_pretrained(
            src[0], dtype=torch.float32, **kw
        ).eval()
        self.load_s = time.perf_counter() - t
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keep = "logits_to_keep" in params
        self.threads = dict(decode=cores, prefill=cores)
        self.calibration = self._calibrate(sorted({cores, 1}, reverse=True))
        self.versions = dict(
            torch=torch.__version__,
            transformers=tf.__version__,
            attn_implementation=self.model.config._attn_implementation,
            threads=dict(self.threads),
            thread_trial_ms=self.calibration,
        )

    def _calibrate(self, candidates: list[int]) -> dict[str, dict[int, float]]:
        """ms of a 4-step batch-1 decode and of a 64-token prefill per
        thread count (each after a warm-up call); keeps the faster."""
        vocab = self.model.config.vocab_size
        prompt = [1 + i % (vocab - 1) for i in range(64)]
        state = self.decode_setup([prompt[:32]])
        ms: dict[str, dict[int, float]] = dict(decode={}, prefill={})
        for th in candidates:
            self.threads = dict(decode=th, prefill=th)
            self.decode_run(state, 1), self.prefill(prompt)
            ms["decode"][th] = 1e3 * self.decode_run(state, 4) / 4
            ms["prefill"][th] = 1e3 * self.prefill(prompt)
        self.threads = {k: min(t, key=t.get) for k, t in ms.items()}
        return ms

    def _forward(self, ids, cache=None):
        kw = {self._cache_kw: cache} if cache is not None else {}
        if self._keep:
            kw["logits_to_keep"] = 1
        return self.model(input_ids=ids, use_cache=True, **kw)

    def prefill(self, prompt: list[int]) -> float:
        """Seconds from the prompt to its first greedy token."""
        self.torch.set_num_threads(self.threads["prefill"])
        with self.torch.inference_mode():
            t = time.perf_counter()
            out = self._forward(self.torch.tensor([prompt]))
            int(out.logits[0, -1].argmax())
            return time.perf_counter() - t

    def decode_setup(self, prompts: list[list[int]]) -> dict[str, Any]:
        """Prefill equal-length prompts as one batch (untimed)."""
        with self.torch.inference_mode():
            out = self._forward(self.torch.tensor(prompts))
            return dict(cache=getattr(out, self._cache_kw), first=out.logits[:, -1].argmax(-1))

    def decode_run(self, state: dict[str, Any], steps: int) -> float:
        """Seconds for `steps` greedy decode steps on a copy of the prefilled cache."""
        self.torch.set_num_threads(self.threads["decode"])
        cache = copy.deepcopy(state["cache"])
        tok = state["first"]
        with self.torch.inference_mode():
            t = time.perf_counter()
            for _ in range(steps):
                out = self._forward(tok[:, None], cache)
                cache = getattr(out, self._cache_kw)
                tok = out.logits[:, -1].argmax(-1)
            return time.perf_counter() - t

    def generate_batched(self, prompts: list[list[int]], olens: list[int]) -> dict[str, Any]:
        """All `prompts` in one left-padded `generate` call (static batching:
        every row decodes max(olens) tokens, greedy, the end token never
        stops it); output tokens counted are the olens asked for, the work
        jaxkv does for the same requests."""
        torch = self.torch
        torch.set_num_threads(self.threads["decode"])
        width = max(map(len, prompts))
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        n = max(olens)
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
            wall = time.perf_counter() - t
        if out.shape[1] != width + n:
            raise RuntimeError(f"HF generate returned {out.shape[1] - width} tokens, asked {n}")
        return dict(
            wall_s=wall,
            output_tokens=sum(olens),
            prompt_tokens=sum(map(len, prompts)),
            generated_tokens=n * len(prompts),
        )


def _hf_source(model: str) -> tuple[str, str | None]:
    """(folder, gguf file name or None) for transformers' from_pretrained."""
    from scripts.bench.peer_jaxkv import jaxkv_model_source

    path = Path(jaxkv_model_source(model)).expanduser()  # a known model: its GGUF
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir() and (path / "config.json").is_file():
        return str(path), None
    raise ValueError(f"--peer hf: {model!r} is neither a GGUF file nor a Hugging Face folder")
