"""jaxkv: LLM inference in JAX on a functional paged KV cache."""

from jaxkv.sequence import SamplingParams, RequestOutput, CompletionOutput  # noqa: F401


def __getattr__(name):
    # LLM and LLMEngine import jax and flax; load them on first use.
    if name == "LLM":
        from jaxkv.llm import LLM
        return LLM
    if name == "LLMEngine":
        from jaxkv.engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)
