"""The network and its cache, as the device sees them: the Flax NNX decoder
(`llama`, `layers`, `quant`), its parameter contract (`params`), the paged
KV cache pytree (`kv_cache`), the attention call into `pallas_kernels`
(`attention`), and the KV size formula and planner (`memory`)."""
