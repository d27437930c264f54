"""Counting compiles (JAX's own monitoring events), for tests that a run
compiles nothing new."""

import contextlib

import jax.monitoring

# Every new program is lowered to MLIR, whether XLA then compiles it or the
# persistent compilation cache serves it; only the former is a backend compile.
LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
    """Yields a list that collects one duration per program lowered (a new
    program, compiled or loaded from the persistent cache) while the block
    runs."""
    events: list[float] = []

    def on(name, duration, **_):
        if name == LOWERING:
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(on)
