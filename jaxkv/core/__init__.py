"""The host side of serving, the way a request flows: its parameters and
state (`sampling_params`, `sequence`, `outputs`), its checks and queueing
(`requests`, `intake`), where its KV pages live and how far it got
(`page_pool`, `block_manager`, `progress`), what runs each step
(`scheduler`, `spec_decode`, `draft`), the step plan handed to the worker
(`step_plan`, `executor`, `overlap`), tokens to text and outputs
(`detokenizer`, `output_processor`), and the engine that wires them
(`engine`). Plain Python: nothing here imports jax except through the
worker."""
