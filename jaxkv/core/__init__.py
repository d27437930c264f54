"""The host side of serving, the way a request flows: its parameters and
state (`sampling_params`, `sequence`, `outputs`), where its KV pages live
(`block_manager`, `prefix_cache`), what runs each step (`scheduler`), and the
engine that ties them to the device (`engine`, with `requests` for input
checks and `output_processor` for text and streaming). Plain Python: nothing
here imports jax except through the worker."""
