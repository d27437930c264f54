"""KV beyond the device pool: the host and disk tiers (`tiers`, `disk`) and importance-based eviction (`evict`)."""
