"""The server's Prometheus metrics (`GET /metrics`), named as an operator of
vLLM expects them under the `jaxkv:` prefix. One registry per server, so
several servers (tests) in one process never mix their figures.

Gauges are refreshed by the engine loop after every step; counters and
histograms are fed as outputs arrive (the engine thread) or as the HTTP
layer refuses a request (handler side)."""

from __future__ import annotations

import re

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401 - the /metrics content type
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from jaxkv.core.spec.decode import SpecStats

# No `*_created` timestamp series beside every counter (as vLLM's server).
prometheus_client.disable_created_metrics()

# Seconds; a CPU step of the default model is ~30 ms, a cold compile ~10 s.
_LATENCY = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


class ServerMetrics:
    def __init__(self, model_name: str):
        r = self.registry = CollectorRegistry()
        m = ["model_name"]
        self.model_name = model_name

        def gauge(name, doc):
            return Gauge(f"jaxkv:{name}", doc, m, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"jaxkv:{name}", doc, m, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(f"jaxkv:{name}", doc, m, buckets=buckets, registry=r).labels(
                model_name
            )

        self.running = gauge(
            "num_requests_running",
            "Requests admitted to the engine (holding KV pages); n answers count once.",
        )
        self.waiting = gauge(
            "num_requests_waiting", "Requests queued for admission; n answers count once."
        )
        self.kv_usage = gauge(
            "kv_cache_usage_perc", "Fraction of KV pages held by requests (1 = full)."
        )
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prompt tokens served from the prefix cache."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter(
            "generation_tokens", "Tokens generated, every answer of n counted."
        )
        self.preemptions = counter(
            "num_preemptions", "Requests preempted (recomputed later) when the page pool ran dry."
        )
        self.spec_drafts = counter(
            "spec_decode_num_drafts",
            "Speculative drafts verified (a sequence's proposals in one step).",
        )
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Speculative tokens proposed."
        )
        self.spec_accepted = counter(
            "spec_decode_num_accepted_tokens", "Speculative tokens the target accepted."
        )
        self.lora_adapters = gauge(
            "lora_adapters", "LoRA adapters the server knows (loaded, in host memory)."
        )
        self.lora_slots = gauge("lora_slots_in_use", "LoRA device slots read by running requests.")
        self.lora_loads = counter(
            "lora_slot_loads",
            "Adapters written into a device slot (a slot's previous adapter evicted).",
        )
        self._tier_hits = Counter(
            "jaxkv:kv_offload_hit_tokens",
            "Prompt tokens served from a KV tier below the device pool (tier: host or disk).",
            m + ["tier"],
            registry=r,
        )
        self._tier_pages = Counter(
            "jaxkv:kv_offload_pages",
            "KV pages copied between the device and the host tier (direction: out or in).",
            m + ["direction"],
            registry=r,
        )
        self._tier_bytes = Counter(
            "jaxkv:kv_offload_bytes", "Bytes of those copies.", m + ["direction"], registry=r
        )
        self.tier_seconds = counter(
            "kv_offload_copy_seconds",
            "Seconds spent moving KV pages between the tiers (disk included).",
        )
        self._tier_held = Gauge(
            "jaxkv:kv_offload_tier_bytes",
            "Bytes of KV pages a tier holds (tier: host or disk).",
            m + ["tier"],
            registry=r,
        )
        self.evicted_tokens = counter(
            "kv_evicted_tokens",
            "Tokens dropped from requests' KV by importance eviction (kv_eviction).",
        )
        self.kv_transfer_pages = Counter(
            "jaxkv:kv_transfer_pages",
            "KV pages handed from a prefill server to a decode server (direction: sent or "
            "received; transport: jax, JAX's transfer server, or tcp, the bootstrap socket).",
            m + ["direction", "transport"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "jaxkv:kv_transfer_bytes",
            "Bytes of those pages, as framed on the wire.",
            m + ["direction"],
            registry=r,
        )
        self.kv_transfer_seconds = hist(
            "kv_transfer_seconds",
            "Decode side: a prompt's pages on the wire, from the prefill server's first "
            "answer byte (its prefill done) to the last page checked.",
            _LATENCY,
        )
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first output token.", _LATENCY)
        self.itl = hist(
            "inter_token_latency_seconds",
            "Time between output tokens (a multi-token output shares its gap).",
            _ITL,
        )
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to final output.", _LATENCY)
        self._success = Counter(
            "jaxkv:request_success",
            "Requests finished, by finish reason.",
            m + ["finished_reason"],
            registry=r,
        )
        self._errors = Counter(
            "jaxkv:request_errors",
            "Requests refused or failed, by reason.",
            m + ["reason"],
            registry=r,
        )
        self._routed = Counter(
            "jaxkv:moe_routed_tokens",
            "Token choices routed to each expert of "
            "a mixture of experts, summed over layers (k per token per sparse "
            "layer; every row the model ran, rejected speculative rows "
            "included); a skewed router shows as a few large experts.",
            m + ["expert"],
            registry=r,
        )
        self._seen = dict(
            queries=0, hits=0, preemptions=0, drafts=0, proposed=0, accepted=0, lora_loads=0
        )
        self._routed_seen = None

    def error(self, reason: str) -> None:
        self._errors.labels(self.model_name, reason).inc()

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def refresh(self, engine, counts: tuple[int, int] | None = None) -> None:
        """Read the engine's state after a step (engine thread only);
        `counts`: (running, waiting) requests, from `request_counts`."""
        sched, bm = engine.scheduler, engine.bm
        counts = counts if counts is not None else request_counts(sched, exact=True)
        self.running.set(counts[0])
        self.waiting.set(counts[1])
        self.kv_usage.set(bm.num_used_pages / (bm.num_pages - 1))
        spec = engine.spec.stats if engine.spec is not None else SpecStats()
        loras = getattr(engine, "loras", None)
        if loras is not None:
            self.lora_adapters.set(len(loras.known))
            self.lora_slots.set(len({s.lora_slot for s in sched.running} - {0}))
        for key, now, metric in (
            ("lora_loads", loras.stats["slot_loads"] if loras else 0, self.lora_loads),
            ("queries", bm.prefix_query_tokens, self.prefix_queries),
            ("hits", bm.prefix_hit_tokens, self.prefix_hits),
            ("preemptions", sched.num_preemptions, self.preemptions),
            ("drafts", spec.drafts, self.spec_drafts),
            ("proposed", spec.proposed, self.spec_draft_tokens),
            ("accepted", spec.accepted, self.spec_accepted),
        ):
            if now > self._seen[key]:
                metric.inc(now - self._seen[key])
            self._seen[key] = now
        self._count_routed(getattr(getattr(engine, "runner", None), "routed", None))
        self._count_tiers(engine.kv_metrics() if hasattr(engine, "kv_metrics") else {})

    def _count_tiers(self, kv: dict) -> None:
        """The KV tiers' and eviction's counters (from `LLMEngine.kv_metrics`)."""
        if not kv:
            return
        name = self.model_name
        for key, metric in (
            ("host_hit_tokens", self._tier_hits.labels(name, "host")),
            ("disk_hit_tokens", self._tier_hits.labels(name, "disk")),
            ("pages_out", self._tier_pages.labels(name, "out")),
            ("pages_in", self._tier_pages.labels(name, "in")),
            ("bytes_out", self._tier_bytes.labels(name, "out")),
            ("bytes_in", self._tier_bytes.labels(name, "in")),
            ("copy_seconds", self.tier_seconds),
            ("evicted_tokens", self.evicted_tokens),
        ):
            now, seen = kv.get(key, 0), self._seen.get(key, 0)
            if now > seen:
                metric.inc(now - seen)
            self._seen[key] = now
        if "host_bytes" in kv:
            self._tier_held.labels(name, "host").set(kv["host_bytes"])
            self._tier_held.labels(name, "disk").set(kv["disk_bytes"])

    def _count_routed(self, routed) -> None:
        if routed is None:
            return
        if self._routed_seen is None:  # every expert's series from the start, idle ones at 0
            for x in range(len(routed)):
                self._routed.labels(self.model_name, str(x))
        seen = self._routed_seen if self._routed_seen is not None else 0 * routed
        for x in (routed - seen).nonzero()[0]:
            self._routed.labels(self.model_name, str(x)).inc(int(routed[x] - seen[x]))
        self._routed_seen = routed.copy()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def request_counts(sched, *, exact: bool) -> tuple[int, int]:
    """(running, waiting) requests in the scheduler (engine thread only): the
    n sequences of a request count once, as running while any of them runs.
    With `exact` False (no request of n > 1 in flight) every sequence is a
    request, and the queues' lengths are the answer without a scan."""
    if not exact:
        return len(sched.running), len(sched.waiting)
    running = {s.parent.request_id for s in sched.running}
    return len(running), len({s.parent.request_id for s in sched.waiting} - running)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?(\s.*)$")


def merge_metrics(texts: list[tuple[str, str]]) -> str:
    """Prometheus texts of (engine label, text) as one text: each family's
    HELP / TYPE once, then every engine's samples, labelled."""
    families: dict[str, list] = {}
    for engine, text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# "):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    meta, _ = families.setdefault(family, ([], []))
                    if line not in meta:
                        meta.append(line)
                continue
            m = _SAMPLE.match(line)
            if not m or family is None:
                continue
            name, labels, rest = m.groups()
            label = f'engine="{engine}"'
            labels = "{" + (labels[1:-1] + "," if labels and labels != "{}" else "") + label + "}"
            families[family][1].append(f"{name}{labels}{rest}")
    out = []
    for meta, samples in families.values():
        out += meta + samples
    return "\n".join(out) + "\n"
