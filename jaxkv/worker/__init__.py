"""What crosses from the host to the device each step and what runs there:
the fixed-shape step data and its buckets (`step_batch`), the stop rules
shared by host and device (`stop`), the in-jit sampler (`sampler`), the
jitted step programs (`step`), and the `Runner` that owns the cache,
compiles the programs (warm-up) and runs them."""
