"""What crosses from the host to the device each step and what runs there:
the typed plan and result the host core hands over and reads back
(`plan`), the fixed-shape step data it is packed into and its buckets
(`step_batch`, `buckets`), the stop rules shared by host and device
(`stop`), the in-jit sampler (`sampler`), the jitted step programs
(`step`, `verify`), their compiled cache (`programs`, `program_store`),
and the `Runner` that owns the model, the cache and the programs. Nothing
here sees a request or a sequence object."""
