"""How users reach the engine: the offline `LLM` API (`llm`), the `jaxkv`
command (`cli`, its options derived from the config dataclasses in
`cli_options`) and JSONL batch jobs (`batch`)."""
