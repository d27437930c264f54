"""jaxkv's side of the generation benchmarks (scripts/bench/generation.py): the engine
with its defaults but the pool size, driven through its public API.

Warm-up is the engine's own (`EngineConfig.warmup`: every step program is
compiled at start); the runner's `stats` (step calls and their wall time)
split each timed run into device time and host overhead, and a compile
meter counts any compile left inside a timed run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from scripts.bench.common import CompileMeter, _timed, prompt_stream

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclasses.dataclass
class Req:
    prompt: list[int]
    max_tokens: int


class JaxkvBench:
    """jaxkv through its engine, default settings but the pool size.

    Every workload submission replaces the first token of each prompt by a
    fresh "salt" token, so the prefix cache (on, as by default) never serves
    one run from pages another run computed; within a run prompts share no
    page. Token counts stay the same."""

    # Decode requests have this many tokens to spare after the timed
    # window (they are aborted at its end, never finish inside it).
    DECODE_MARGIN = 64

    def __init__(
        self,
        model: str,
        sizes,
        meter: CompileMeter,
        quantize: str | None = None,
        tensor_parallel_size: int = 1,
        *,
        share: JaxkvBench | None = None,
        max_num_batched_tokens: int | None = None,
        engine_options: dict | None = None,
    ):
        """`max_num_batched_tokens`: an engine for lone prompts (one
        sequence a step) with this token budget instead of the default;
        `share`: reuse that bench's weights and tokenizer, not a new load;
        `engine_options`: more EngineConfig fields (enable_expert_parallel, ...)."""
        import jax

        from jaxkv import LLMEngine
        from jaxkv.config import EngineConfig
        from scripts.bench.common import e2e_lengths

        self.sizes = sizes
        self.meter = meter
        e2e_p, e2e_o = e2e_lengths(sizes)
        ps = 16
        pages = lambda n: -(-n // ps)  # noqa: E731
        longest = max(pages(n + 1) for n in (1, *sizes.prefill_lens, *sizes.prefill_chunked))
        need = max(
            max(sizes.decode_batches)
            * pages(sizes.decode_prompt + sizes.decode_steps + self.DECODE_MARGIN),
            sum(pages(p + o) for p, o in zip(e2e_p, e2e_o)),
            longest,
        )
        # None: the engine's default (a GGUF's weights kept in their blocks on CPU);
        # "gguf-blocks": kept, asked for; "float32": every weight dequantized.
        blocks = dict(gguf_blocks={"gguf-blocks": True, "float32": False}.get(quantize))
        quantize = None if quantize in ("float32", "gguf-blocks") else quantize
        kw = dict(
            page_size=ps,
            num_pages=need + 2,
            quantize=quantize,
            **blocks,
            max_num_seqs=max(64, *sizes.decode_batches),
            tensor_parallel_size=tensor_parallel_size,
        )
        kw.update(engine_options or {})
        if max_num_batched_tokens is not None:
            kw.update(
                num_pages=longest + 2, max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens
            )
        s0, n0, h0 = meter.snapshot()
        if share is None:
            t, self.engine = _timed(lambda: LLMEngine.from_pretrained(model, **kw))
        else:
            from flax import nnx

            module = nnx.merge(share.runner.graphdef, share.runner.state)
            t, self.engine = _timed(lambda: LLMEngine(module, share.tokenizer, EngineConfig(**kw)))
        s1, n1, h1 = meter.snapshot()
        report = self.engine.warmup_report or dict(programs=0, seconds=0.0)
        self.warm_up = dict(
            new_programs=report["programs"],
            wall_s=report["seconds"],
            xla_compiles=n1 - n0,
            cache_hits=h1 - h0,
            compile_s=s1 - s0,
        )
        self.load_s = t - report["seconds"]
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.model_config
        self.stream = prompt_stream(
            self.tokenizer,
            self.config.vocab_size,
            max(
                [
                    sizes.decode_prompt,
                    *sizes.prefill_lens,
                    *sizes.prefill_chunked,
                    sizes.e2e_prompt[1],
                ]
            ),
        )
        self._salts = sorted(set(self.stream))
        self._submissions = 0
        # Bytes a batch-1 step reads: every weight, but the embedding table
        # only where it is also the head (tied, no separate lm_head); else
        # its rows are gathered, not read whole.
        paths = [
            (jax.tree_util.keystr(p), x)
            for p, x in jax.tree_util.tree_leaves_with_path(self.runner.state)
        ]
        self.weight_bytes = sum(x.nbytes for _, x in paths)
        if any("lm_head" in k for k, _ in paths):
            self.weight_bytes -= sum(x.nbytes for k, x in paths if "embed" in k)
        cache = self.runner.cache
        self.kv_bytes_per_token = cache.nbytes() // (cache.num_pages * cache.page_size)

    @property
    def runner(self):
        return self.engine.runner

    def _salted(self, prompts: list[list[int]]) -> list[list[int]]:
        self._submissions += 1
        salt = self._salts[self._submissions % len(self._salts)]
        return [[salt] + list(p[1:]) for p in prompts]

    def _params(self, max_tokens: int):
        from jaxkv import SamplingParams

        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def _submit(self, prompts: list[list[int]], max_tokens: list[int]) -> list[str]:
        return [
            self.engine.add_request({"prompt_token_ids": p}, self._params(m))
            for p, m in zip(self._salted(prompts), max_tokens)
        ]

    def _timed_engine(self, fn: Callable[[], Any]) -> tuple[float, Any, dict[str, Any]]:
        """Run `fn`; (wall seconds, its result, runner calls / seconds and
        compiles inside it)."""
        st = dict(self.runner.stats)
        _, n0, _ = self.meter.snapshot()
        wall, out = _timed(fn)
        _, n1, _ = self.meter.snapshot()
        return (
            wall,
            out,
            dict(
                engine_steps=self.runner.stats["calls"] - st["calls"],
                runner_s=self.runner.stats["seconds"] - st["seconds"],
                new_compiles=n1 - n0,
            ),
        )

    def decode_run(self, prompts: list[list[int]], steps: int) -> dict[str, Any]:
        """Prefill `prompts` (untimed), then time the engine while every
        sequence decodes `steps` more tokens (pure decode at batch
        len(prompts)); the requests are aborted afterwards."""
        eng = self.engine
        rids = self._submit(prompts, [steps + self.DECODE_MARGIN] * len(prompts))
        seqs = [eng.get_request(r) for r in rids]
        while any(not s.num_output_tokens for s in seqs):
            eng.step()
        start = [s.num_output_tokens for s in seqs]
        ctx = sum(s.num_tokens for s in seqs)

        def run():
            while min(s.num_output_tokens - n for s, n in zip(seqs, start)) < steps:
                eng.step()

        wall, _, m = self._timed_engine(run)
        if any(s.finished for s in seqs):
            raise RuntimeError("a decode request finished inside the timed window")
        tokens = sum(s.num_output_tokens - n for s, n in zip(seqs, start))
        for r in rids:
            eng.abort(r)
        eng.step()
        B = len(prompts)
        # live K/V tokens per decode step, averaged over the window
        return dict(seconds=wall, tokens=tokens, kv_tokens_per_step=ctx + tokens / 2 - B / 2, **m)

    def engine_run(self, reqs: list[Req], *, sequential: bool) -> dict[str, Any]:
        """All requests at once (or one after another); returns wall time,
        token counts, per-request time to first token and engine host time."""
        eng = self.engine
        prompts = self._salted([r.prompt for r in reqs])
        params = [self._params(r.max_tokens) for r in reqs]

        def run():
            if sequential:
                outs = []
                for p, sp in zip(prompts, params):
                    rid = eng.add_request({"prompt_token_ids": p}, sp)
                    outs.append(eng.run_to_completion([rid])[rid])
                return outs
            rids = [eng.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
            final = eng.run_to_completion(rids)
            return [final[rid] for rid in rids]

        wall, outs, m = self._timed_engine(run)
        for o, r in zip(outs, reqs):
            if len(o.outputs[0].token_ids) != r.max_tokens:
                raise RuntimeError(
                    f"request {o.request_id}: {len(o.outputs[0].token_ids)} tokens, "
                    f"expected {r.max_tokens} ({o.outputs[0].finish_reason})"
                )
        ttft = [o.metrics["first_token"] - o.metrics["arrival"] for o in outs]
        return dict(
            wall_s=wall,
            output_tokens=sum(len(o.outputs[0].token_ids) for o in outs),
            prompt_tokens=sum(len(r.prompt) for r in reqs),
            ttft_s=ttft,
            **m,
        )


def jaxkv_model_source(model: str) -> str:
    """A known model is read from its GGUF, the file HF reads too."""
    from checkpoints.known_models import GEMMA3_MODEL, fetch_gemma3_gguf, fetch_smollm2_gguf

    if model.lower() == DEFAULT_MODEL:
        return str(fetch_smollm2_gguf())
    if model.lower() == GEMMA3_MODEL:
        return str(fetch_gemma3_gguf())
    return model
