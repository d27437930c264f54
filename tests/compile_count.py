"""Counting XLA compiles (JAX's own monitoring events), for tests that a run
compiles nothing new."""

import contextlib

import jax.monitoring

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
    """Yields a list that collects the duration of every XLA backend compile
    while the block runs (a persistent-cache hit is no backend compile, so
    tests that count run with the cache they set up themselves)."""
    events: list[float] = []

    def on(name, duration, **_):
        if name == BACKEND_COMPILE:
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(on)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(on)
