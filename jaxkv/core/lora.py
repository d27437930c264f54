"""The engine's LoRA adapters on the host: which are known (read once, kept
as host copies), which sit in the `max_loras` device slots, and which
sequence runs with which slot.

    LoRARequest(lora_name, lora_int_id, lora_path)   what a request names (vLLM's shape)
    adapters.resolve(request) -> Adapter             read and checked on first use
    adapters.admit(seq, running) -> bool             a slot for a sequence starting to run
    adapters.remove(name)                            no new request may name it

A sequence gets its slot when the scheduler admits it: the slot that holds
its adapter already, else the least recently used slot that no running
sequence reads, whose arrays are then rewritten (`Runner.set_lora`: the
stack's arrays replaced whole, placed like the old ones, so no program
compiles). When every slot is read by running sequences, the sequence
waits, as it would for pages. Steps in flight keep the arrays they were
given, so a slot rewritten under them changes nothing they compute.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np
from flax import nnx

from jaxkv.model.lora import (GROUPS, LoRAStack, LoRAWeights, a_columns, read_adapter,
                              stack_shapes, target_shapes)
from jaxkv.shard_columns import kv_columns


def attach_lora(model, config):
    """(the model to run, the config adapters are read for: the model's as
    loaded). With `config.enable_lora` (an `EngineConfig`), a copy of
    `model` (a `jaxkv.model.llama.Llama`, not placed yet; its arrays
    shared, the caller's module unchanged) with empty LoRA slots."""
    if not config.enable_lora:
        return model, model.config
    model = nnx.merge(*nnx.split(model))
    model.lora = LoRAStack(model.config, config.max_loras, config.max_lora_rank,
                           model.final_norm[...].dtype)
    return model, model.config


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with: its name (what a server request's
    `model` says), a positive integer id, and its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclasses.dataclass(eq=False)
class Adapter:
    """An adapter known to the engine: its request, its factors (host
    copies), and `key`, a digest of its factors (the prefix cache's: pages
    are shared between requests of the same weights only)."""

    request: LoRARequest
    weights: LoRAWeights
    key: bytes


class LoRAAdapters:
    """`config`: the model as loaded (KV heads unreplicated); `plan`: the
    `jaxkv.sharding.ShardingPlan` or None; `write(arrays)`: replaces the
    device stack's arrays by name (`Runner.set_lora`)."""

    def __init__(self, config, max_loras: int, max_rank: int, write, plan=None):
        self.config, self.max_loras, self.rank, self.write = config, max_loras, max_rank, write
        self.known: dict[str, Adapter] = {}
        self.slots: list[Adapter | None] = [None] * max_loras
        self._lru = collections.deque(range(max_loras))  # least recently used first
        # K / V columns of the stored (replicated) KV heads under tensor parallelism
        self._kv = (kv_columns(config, plan) if plan is not None and plan.kv_replicas > 1
                    else None)
        self.host = {name: np.zeros(shape[:3] + (len(self._kv),) if self._kv is not None and
                                     name in ("b_k", "b_v") else shape, np.float32)
                     for name, shape in stack_shapes(config, max_loras, max_rank).items()}
        self.stats = dict(slot_loads=0)

    def resolve(self, request) -> Adapter:
        """The adapter of a request's `lora_request` (a LoRARequest, or the
        name of a known adapter), read and checked when it is new.
        ValueError naming the problem."""
        if isinstance(request, str):
            if request not in self.known:
                raise ValueError(f"lora_request: unknown adapter {request!r} (known: "
                                 f"{sorted(self.known) or 'none'})")
            return self.known[request]
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest, got {type(request).__name__}")
        name, lid = request.lora_name, request.lora_int_id
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_request: lora_name must be a non-empty string, got {name!r}")
        if not isinstance(lid, int) or isinstance(lid, bool) or lid < 1:
            raise ValueError(f"lora_request: lora_int_id must be a positive integer, got {lid!r}")
        have = self.known.get(name)
        if have is not None and have.request == request:
            return have
        if have is not None:
            raise ValueError(f"lora_request: adapter {name!r} is loaded as "
                             f"{have.request.lora_path!r} (id {have.request.lora_int_id}); "
                             "unload it first")
        clash = next((a for a in self.known.values() if a.request.lora_int_id == lid), None)
        if clash is not None:
            raise ValueError(f"lora_request: lora_int_id {lid} is adapter "
                             f"{clash.request.lora_name!r}'s")
        w = read_adapter(request.lora_path, self.config, self.rank)
        h = hashlib.blake2b(digest_size=16)
        for t in sorted(w.a):
            h.update(t.encode() + w.a[t].tobytes() + w.b[t].tobytes())
        ad = self.known[name] = Adapter(request, w, h.digest())
        return ad

    def remove(self, name: str) -> bool:
        """Forget adapter `name` (False: unknown). Running and queued requests
        keep it; its slot is reused once none reads it."""
        return self.known.pop(name, None) is not None

    def admit(self, seq, running) -> bool:
        """Give `seq` (starting to run) its adapter's slot; False when every
        slot is read by the `running` sequences (it waits)."""
        ad = seq.lora
        if ad is None:
            seq.lora_slot = 0
            return True
        i = next((i for i, s in enumerate(self.slots) if s is not None and s.key == ad.key), None)
        if i is None:
            busy = {s.lora_slot for s in running}
            i = next((j for j in self._lru if j + 1 not in busy), None)
            if i is None:
                return False
            self._load(i, ad)
        self._lru.remove(i)
        self._lru.append(i)
        seq.lora_slot = i + 1
        return True

    def _load(self, i: int, ad: Adapter) -> None:
        w = ad.weights
        for t in target_shapes(self.config):
            g = next(g for g, parts in GROUPS.items() if t in parts)
            a, b = self.host[f"a_{g}"][:, i], self.host[f"b_{t}"][:, i]  # views of slot i
            cols = a_columns(t, self.rank)
            a[..., cols] = 0
            b[...] = 0
            if t in w.a:
                a[..., cols.start:cols.start + w.rank] = w.a[t]
                b[:, :w.rank] = w.b[t] if self._kv is None or t not in ("k", "v") else \
                    w.b[t][..., self._kv]
        self.slots[i] = ad
        self.stats["slot_loads"] += 1
        self.write(self.host)

    def names(self) -> list[str]:
        return sorted(self.known)
