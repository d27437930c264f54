"""jaxkv: LLM inference in JAX on a functional paged KV cache.

    from jaxkv import LLM, SamplingParams        # offline generation
    from jaxkv import LLMEngine                  # add_request / step / abort
    from jaxkv import LoRARequest                # an adapter for a request (enable_lora)

Layout: `jaxkv.core` (the host side: requests, pages, scheduling, the
engine), `jaxkv.model` (the network and its cache), `jaxkv.worker` (the
step's device data and the jitted programs), `jaxkv.entrypoints` (LLM, the
`jaxkv` command, batch jobs); checkpoints live in the `checkpoints` package
and attention kernels in `pallas_kernels`.
"""

from jaxkv.core.outputs import CompletionOutput, RequestOutput  # noqa: F401
from jaxkv.core.sampling_params import SamplingParams  # noqa: F401


def __getattr__(name):
    # LLM and LLMEngine import jax and flax; load them on first use.
    if name == "LLM":
        from jaxkv.entrypoints.llm import LLM

        return LLM
    if name == "LoRARequest":
        from jaxkv.core.adapters.lora import LoRARequest

        return LoRARequest
    if name == "LLMEngine":
        from jaxkv.core.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
