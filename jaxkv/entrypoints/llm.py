"""The offline API, shaped like vLLM's:

    from jaxkv import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outs = llm.generate(["What is a KV cache?"], SamplingParams(max_tokens=64))
    print(outs[0].outputs[0].text)

`model` is the name of a known model (fetched and converted once into the
cache folder) or a path: a Hugging Face folder, a GGUF file or a jaxkv
checkpoint. Engine options (EngineConfig fields) pass as keywords; compiled
step programs are kept across runs (`program_cache`, or JAX's persistent
compilation cache where that store does not serve: `jaxkv.paths`).

One LLM may be shared by threads: `generate` and `chat` calls are
serialized (a lock around the engine), so each caller gets its own correct
outputs, one call after another.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from jaxkv.core.engine import LLMEngine
from jaxkv.core.outputs import RequestOutput
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.paths import enable_compilation_cache, uses_program_store


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", **engine_options: Any):
        if not uses_program_store(engine_options):
            enable_compilation_cache()
        self.engine = LLMEngine.from_pretrained(model, **engine_options)
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.Lock()

    def follow(self) -> bool:
        """Processes 1..n-1 of a multi-process job (`num_processes`,
        `process_id`, `coordinator_address`): run the steps process 0's
        LLM sends until it shuts down or exits, then True. False at once
        on process 0, which takes the requests."""
        return self.engine.follow()

    def shutdown(self) -> None:
        """Process 0 of several: release the followers (done at exit too)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. Prompts: a string, a list of
        strings, or dicts {"prompt": ...} / {"prompt_token_ids": [...]} (a list
        of ints alone is read as one tokenized prompt). A bad prompt gets an
        output with finish_reason "error"; the rest are generated.
        `lora_request`: a `LoRARequest` (engine option enable_lora) for every
        prompt, or a list of them (None: the base model) one per prompt."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts"
                )
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        loras = (
            list(lora_request)
            if isinstance(lora_request, (list, tuple))
            else ([lora_request] * len(prompts))
        )
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        with self._lock:
            return self._generate(prompts, params, use_tqdm, loras)

    def _generate(self, prompts, params, use_tqdm, loras) -> list[RequestOutput]:
        ids: list[str] = []
        bar = None
        if use_tqdm or (use_tqdm is None and len(prompts) >= 16):
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="generate", unit="req", dynamic_ncols=True)
        generated = [0]

        def progress(done, new):
            generated[0] += new
            if bar is not None:
                bar.n = done
                el = bar.format_dict.get("elapsed") or 0
                bar.set_postfix_str(f"{generated[0] / el:.1f} tok/s" if el else "")
                bar.refresh()

        try:
            for p, sp, lr in zip(prompts, params, loras):
                ids.append(self.engine.add_request(p, sp, lora_request=lr))
            final = self.engine.run_to_completion(ids, progress)
        finally:
            if bar is not None:
                bar.close()
            # Whatever stopped this call (an exception, Ctrl-C), none of its
            # requests stays queued for the next one.
            for rid in ids:
                self.engine.abort(rid)
            eng = self.engine
            while eng.has_unfinished_requests() and not eng.scheduler.has_unfinished():
                eng.step()
        return [final[i] for i in ids]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool | None = None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of
        {"role", "content"} dicts) or a list of them, then generate. A
        malformed conversation raises ValueError before anything runs."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise ValueError(
                "messages: this model has no chat template (a base model?); "
                "use generate() with a prompt"
            )
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(
                f"messages: must be a non-empty list of {{'role', 'content'}} dicts "
                f"or a list of such lists, got {type(messages).__name__}"
            )
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        for i, c in enumerate(convs):
            if (
                not isinstance(c, (list, tuple))
                or not c
                or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in c
                )
            ):
                raise ValueError(
                    f"messages: conversation {i} must be a non-empty list of "
                    "{'role': str, 'content': str} dicts"
                )
        prompts = [
            {
                "prompt_token_ids": self.tokenizer.encode(
                    self.tokenizer.apply_chat_template(c, add_generation_prompt=True),
                    add_special_tokens=False,
                )
            }
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
