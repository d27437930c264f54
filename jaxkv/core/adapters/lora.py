"""The engine's LoRA adapters on the host: which are known (read once, kept
as host copies), which sit in the `max_loras` device slots, and which
sequence runs with which slot.

    LoRARequest(lora_name, lora_int_id, lora_path)   what a request names (vLLM's shape)
    adapters.resolve(request) -> Adapter             read and checked on first use
    adapters.admit(seq, running) -> bool             a slot for a sequence starting to run
    adapters.remove(name)                            no new request may name it

Folders are read by `checkpoints.peft_adapter` (every hostile folder
refused by name); the host keeps at most `max_cpu_loras` adapters'
factors, each at its own rank.

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
import threading

import numpy as np
from flax import nnx

from checkpoints.peft_adapter import LoRAWeights, read_adapter
from jaxkv.model.lora import GROUPS, LoRAStack, a_columns, stack_shapes, target_shapes
from jaxkv.shard_columns import kv_columns


def attach_lora(model, config):
    """(the model to run, the config adapters are read for: the model's as
    loaded). With `config.enable_lora` (an `EngineConfig`), a copy of
    `model` (a `jaxkv.model.llama.Llama`, not placed yet; its arrays
    shared, the caller's module unchanged) with empty LoRA slots."""
    if not config.enable_lora:
        return model, model.config
    model = nnx.merge(*nnx.split(model))
    model.lora = LoRAStack(
        model.config, config.max_loras, config.max_lora_rank, model.final_norm[...].dtype
    )
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


@dataclasses.dataclass(frozen=True, eq=False)
class Adapter:
    """An adapter known to the engine: its request, its factors (host
    copies at the adapter's own rank; None while the host cache does not
    hold them: read again from its folder when a request names it), and
    `key`, a digest of its factors (the prefix cache's: pages are shared
    between requests of the same weights only)."""

    request: LoRARequest
    weights: LoRAWeights | None
    key: bytes


class LoRAAdapters:
    """`config`: the model as loaded (KV heads unreplicated); `sharding`:
    the `jaxkv.sharding.ShardingPlan` or None; `write(arrays)`: replaces the
    device stack's arrays by name (`Runner.set_lora`). At most
    `max_cpu_loras` (default `max_loras`) adapters' factors are held on
    the host, least recently used dropped first; a sequence holds its own
    adapter's factors until it ends. `read` and `resolve` may run on any
    thread (a server reads folders off its engine thread and event loop);
    `admit` runs on the engine thread."""

    def __init__(
        self,
        config,
        max_loras: int,
        max_rank: int,
        write,
        sharding=None,
        max_cpu_loras: int | None = None,
    ):
        self.config = config
        self.max_loras = max_loras
        self.rank = max_rank
        self.write = write
        self.max_cpu_loras = max(max_cpu_loras or max_loras, 1)
        self.known: dict[str, Adapter] = {}
        self._held: collections.OrderedDict[str, None] = collections.OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self.slots: list[bytes | None] = [None] * max_loras  # the key of each slot's adapter
        self._lru = collections.deque(range(max_loras))  # least recently used first
        # K / V columns of the stored (replicated) KV heads under tensor parallelism
        self._kv = (
            kv_columns(config, sharding)
            if sharding is not None and sharding.kv_replicas > 1
            else None
        )
        self.host = {
            name: np.zeros(
                shape[:3] + (len(self._kv),)
                if self._kv is not None and name in ("b_k", "b_v")
                else shape,
                np.float32,
            )
            for name, shape in stack_shapes(config, max_loras, max_rank).items()
        }
        self.stats = dict(slot_loads=0, folder_reads=0)

    def read(self, request: LoRARequest) -> Adapter:
        """`request`'s folder read and checked (slow: any thread, nothing
        registered). ValueError naming the problem."""
        w = read_adapter(request.lora_path, self.config, self.rank)
        h = hashlib.blake2b(digest_size=16)
        for t in sorted(w.a):
            h.update(t.encode() + w.a[t].tobytes() + w.b[t].tobytes())
        with self._lock:
            self.stats["folder_reads"] += 1
        return Adapter(request, w, h.digest())

    def resolve(self, request) -> Adapter:
        """The adapter of a request's `lora_request` (a LoRARequest, the
        name of a known adapter, or an `Adapter` resolved already), its
        factors read when they are not held. ValueError naming the problem."""
        if isinstance(request, Adapter):
            if request.weights is None:
                raise ValueError("lora_request: an adapter whose factors are not held")
            return request
        if isinstance(request, str):
            with self._lock:
                have = self.known.get(request)
                if have is not None and have.weights is not None:
                    self._held.move_to_end(request)
                    return have
            if have is None:
                raise ValueError(f"lora_request: unknown adapter {request[:200]!r}")
            return self._register(self.read(have.request), again=True)
        self.check(request)
        with self._lock:
            have = self.known.get(request.lora_name)
        if have is not None and have.request == request and have.weights is not None:
            return self.resolve(request.lora_name)
        return self._register(
            self.read(request), again=have is not None and have.request == request
        )

    def check(self, request) -> None:
        """ValueError unless `request` is a well-formed LoRARequest that
        clashes with no known adapter of another folder or id."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest, got {type(request).__name__}")
        name, lid = request.lora_name, request.lora_int_id
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora_request: lora_name must be a non-empty string, got {name!r}")
        if not isinstance(lid, int) or isinstance(lid, bool) or lid < 1:
            raise ValueError(f"lora_request: lora_int_id must be a positive integer, got {lid!r}")
        if not isinstance(request.lora_path, str) or not request.lora_path:
            raise ValueError("lora_request: lora_path must be a non-empty string")
        with self._lock:
            have = self.known.get(name)
            if have is not None and have.request != request:
                raise ValueError(
                    f"lora_request: adapter {name!r} is loaded as "
                    f"{have.request.lora_path!r} (id {have.request.lora_int_id}); "
                    "unload it first"
                )
            clash = next(
                (
                    a
                    for a in self.known.values()
                    if a.request.lora_int_id == lid and a.request.lora_name != name
                ),
                None,
            )
        if clash is not None:
            raise ValueError(
                f"lora_request: lora_int_id {lid} is adapter {clash.request.lora_name!r}'s"
            )

    def _register(self, ad: Adapter, again: bool = False) -> Adapter:
        """Make `ad` known and held (dropping the least recently used
        factors past `max_cpu_loras`). `again`: it is a known adapter read
        anew; else its name must still be free."""
        name = ad.request.lora_name
        with self._lock:
            have = self.known.get(name)
            if have is not None and not (again and have.request == ad.request):
                raise ValueError(
                    f"lora_request: adapter {name!r} is loaded already "
                    f"(from {have.request.lora_path!r})"
                )
            if again and have is None:
                raise ValueError(f"lora_request: adapter {name!r} was unloaded")
            self.known[name] = ad
            self._held[name] = None
            self._held.move_to_end(name)
            while len(self._held) > self.max_cpu_loras:
                old, _ = self._held.popitem(last=False)
                a = self.known[old]
                self.known[old] = Adapter(a.request, None, a.key)
        return ad

    def remove(self, name: str) -> bool:
        """Forget adapter `name` (False: unknown). Running and queued requests
        keep it; its slot is reused once none reads it."""
        with self._lock:
            self._held.pop(name, None)
            return self.known.pop(name, None) is not None

    def held_bytes(self) -> int:
        """Host bytes of the factors the cache holds."""
        with self._lock:
            return sum(self.known[n].weights.nbytes for n in self._held)

    def admit(self, seq, running) -> bool:
        """Give `seq` (starting to run) its adapter's slot; False when every
        slot is read by the `running` sequences (it waits)."""
        ad = seq.lora
        if ad is None:
            seq.lora_slot = 0
            return True
        i = next((i for i, key in enumerate(self.slots) if key == ad.key), None)
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
                a[..., cols.start : cols.start + w.rank] = w.a[t]
                b[:, : w.rank] = (
                    w.b[t] if self._kv is None or t not in ("k", "v") else w.b[t][..., self._kv]
                )
        self.slots[i] = ad.key
        self.stats["slot_loads"] += 1
        self.write(self.host)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self.known)
