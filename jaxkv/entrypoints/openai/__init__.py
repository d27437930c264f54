"""The OpenAI-compatible HTTP server (`jaxkv serve`): `server` builds the
FastAPI app, `engine_loop` owns the engine, `protocol` checks bodies,
`generate` runs the generation endpoints, `responses` shapes the JSON,
`metrics` the Prometheus figures."""
