"""PEFT LoRA adapter folders (`adapter_config.json` +
`adapter_model.safetensors`) read into per-layer low-rank factors for
`jaxkv.model.lora`'s stack, refusing a hostile folder by name before it
costs time or memory.

An adapter folder comes from whoever may load one, so nothing in it is
trusted: the config is a bounded regular file (`read_json_file`) whose
every field is checked for its type; the safetensors header's length is
read and bounded first, then its entries (names, dtypes, shapes) are
checked against what the base model can take, all before a byte of tensor
data is read; factors and scales must be finite and the folded scale sane.
Every refusal is a ValueError that names the file or field and why.

PEFT's `alpha_pattern` / `rank_pattern` keys name modules in full or by a
dotted suffix (`k_proj`, `layers.0.self_attn.k_proj`); keys are never run
as regular expressions (a backtracking pattern would hold the process), and
a key that is not a module name is refused by name."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat

import numpy as np

from jaxkv.config import ModelConfig
from jaxkv.model.lora import HF_TARGETS, MLP_TARGETS, target_shapes
from jaxkv.tokenizer import read_json_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 4 << 20  # an adapter of every target on 128 layers has a ~0.3 MB header
MAX_PATTERNS = 4096  # alpha_pattern / rank_pattern keys
MAX_SCALE = 1e4  # |lora_alpha / r| beyond this is no trained adapter
_FLOATS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "BF16": None}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_MODULE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")


@dataclasses.dataclass
class LoRAWeights:
    """One adapter read for `config`: per target, a [L, N_in, r] and b
    [L, r, N_out] float32 (scale folded into b; zeros for layers it does not
    touch), r its rank; each array its own (no view of a larger one)."""

    path: str
    rank: int
    a: dict
    b: dict

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))


def read_adapter(path: str, config: ModelConfig, max_rank: int) -> LoRAWeights:
    """The PEFT adapter in folder `path` for a base model of `config`.
    ValueError naming the problem (see the module's text): a missing or
    irregular file, a field of the wrong type, a rank above `max_rank` or
    of 0, a target jaxkv does not apply (embeddings, lm_head, experts,
    modules_to_save, DoRA, biases), a factor whose shape does not fit the
    base, non-finite values, an absurd scale."""
    where = f"lora: {path}"
    try:
        return _read(str(path), config, max_rank, where)
    except ValueError:
        raise
    except (
        RecursionError,
        MemoryError,
        OSError,
        TypeError,
        KeyError,
        IndexError,
        AttributeError,
        OverflowError,
    ) as e:  # a shape of the folder no check foresaw
        raise ValueError(f"{where}: cannot be read ({type(e).__name__}: {str(e)[:200]})") from None


def _read(path: str, config: ModelConfig, max_rank: int, where: str) -> LoRAWeights:
    try:
        st = os.stat(path)
    except OSError:
        raise ValueError(
            f"lora: {os.path.join(path, CONFIG)} not found (a PEFT adapter folder "
            f"holds {CONFIG} and {WEIGHTS})"
        ) from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(
            f"{where}: not a folder (a PEFT adapter folder holds {CONFIG} and {WEIGHTS})"
        )
    cfg_path = os.path.join(path, CONFIG)
    if not os.path.lexists(cfg_path):
        raise ValueError(
            f"lora: {cfg_path} not found (a PEFT adapter folder holds {CONFIG} and {WEIGHTS})"
        )
    try:
        ac = read_json_file(cfg_path, MAX_CONFIG_BYTES)
    except ValueError as e:  # names the file and why
        raise ValueError(f"lora: {e}") from None
    opts = _options(ac, where)
    shapes = target_shapes(config)
    entries = _header(os.path.join(path, WEIGHTS), 2 * len(shapes) * config.num_layers)
    found = _factors(entries, shapes, config.num_layers, max_rank, where)
    L, rank = config.num_layers, max(r for r, _ in found.values())
    a: dict[str, np.ndarray] = {}
    b: dict[str, np.ndarray] = {}
    st_path = os.path.join(path, WEIGHTS)
    tensors = _tensors(st_path, {n for _, names in found.values() for n in names})
    for (layer, t), (r, (name_a, name_b)) in sorted(found.items()):
        n_in, n_out = shapes[t]
        A, B = tensors[name_a], tensors[name_b]
        if not (np.isfinite(A).all() and np.isfinite(B).all()):
            bad = name_a if not np.isfinite(A).all() else name_b
            raise ValueError(f"{where}: tensor {bad!r} holds NaN or infinite values (in float32)")
        alpha = _pattern(
            opts["alpha_pattern"], layer, t, r if opts["lora_alpha"] is None else opts["lora_alpha"]
        )
        scale = alpha / (math.sqrt(r) if opts["use_rslora"] else r)
        if not math.isfinite(scale) or abs(scale) > MAX_SCALE:
            raise ValueError(
                f"{where}: lora_alpha {alpha!r} over rank {r} gives a scale of "
                f"{scale:g} for layer {layer} {t}; at most {MAX_SCALE:g} is served"
            )
        if t not in a:
            a[t] = np.zeros((L, n_in, rank), np.float32)
            b[t] = np.zeros((L, rank, n_out), np.float32)
        a[t][layer, :, :r] = A.T
        b[t][layer, :r] = B.T * np.float32(scale)
        if not np.isfinite(b[t][layer]).all():
            raise ValueError(
                f"{where}: tensor {name_b!r} times the scale {scale:g} overflows float32"
            )
    return LoRAWeights(path, rank, a, b)


def _options(ac: dict, where: str) -> dict:
    """adapter_config.json's fields jaxkv reads, each checked for its type."""

    def field(name, kinds, default, what):
        v = ac.get(name, default)
        if v is not None and (
            not isinstance(v, kinds) or isinstance(v, bool) and bool not in kinds
        ):
            raise ValueError(f"{where}: {CONFIG}: {name} must be {what}, got {_short(v)}")
        return v

    peft_type = field("peft_type", (str,), "LORA", "a string")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {_short(peft_type)}, only LORA is served")
    for key in ("use_dora", "fan_in_fan_out"):
        if field(key, (bool,), False, "true or false"):
            raise ValueError(f"{where}: {key} is not supported")
    if ac.get("modules_to_save"):
        raise ValueError(
            f"{where}: modules_to_save {_short(ac['modules_to_save'])} (whole "
            "trained modules) are not supported, only low-rank targets"
        )
    if field("bias", (str,), "none", "a string") not in (None, "none"):
        raise ValueError(f"{where}: bias {_short(ac['bias'])} is not supported (only 'none')")
    targets = field("target_modules", (list, str), [], "a list of module names or a string")
    if isinstance(targets, str):
        targets = [] if targets == "all-linear" else [targets]
    if not all(isinstance(t, str) for t in targets or []):
        raise ValueError(
            f"{where}: {CONFIG}: target_modules must be a list of module names, "
            f"got {_short(targets)}"
        )
    unknown = sorted({t.split(".")[-1] for t in targets or []} - set(HF_TARGETS))
    if unknown:
        raise ValueError(
            f"{where}: unknown target modules {_short(unknown)} (jaxkv applies "
            f"LoRA to {sorted(HF_TARGETS)})"
        )
    r = field("r", (int,), 8, "a positive integer")
    if r is not None and r < 1:
        raise ValueError(f"{where}: {CONFIG}: r must be a positive integer, got {r}")
    alpha = field("lora_alpha", (int, float), None, "a number")  # None: each factor's rank
    if alpha is not None and not math.isfinite(alpha):
        raise ValueError(
            f"{where}: {CONFIG}: lora_alpha must be a finite number, got {_short(alpha)}"
        )
    out = dict(
        lora_alpha=alpha, use_rslora=bool(field("use_rslora", (bool,), False, "true or false"))
    )
    for name in ("alpha_pattern", "rank_pattern"):
        p = field(name, (dict,), {}, "an object of module names and numbers") or {}
        if len(p) > MAX_PATTERNS:
            raise ValueError(
                f"{where}: {CONFIG}: {name} has {len(p)} keys, more than the {MAX_PATTERNS} served"
            )
        for k, v in p.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ValueError(
                    f"{where}: {CONFIG}: {name}[{_short(k)}] must be a finite number, "
                    f"got {_short(v)}"
                )
        out[name] = {_module_name(k, name, where): v for k, v in p.items()}
    return out


def _module_name(key: str, field: str, where: str) -> str:
    """A pattern key as the module name (or dotted suffix) it stands for;
    escaped dots are read as dots. Anything else is refused by name."""
    name = key.replace("\\.", ".").removeprefix("^").removesuffix("$")
    if not _MODULE.match(name):
        raise ValueError(
            f"{where}: {CONFIG}: {field} key {_short(key)} is not a module name or "
            "dotted suffix of one (jaxkv does not run pattern keys as regular "
            "expressions)"
        )
    return name


def _pattern(patterns: dict, layer: int, t: str, default):
    """The pattern's value for target t of `layer` (`patterns`' keys: module
    names in full or dotted suffixes), else `default`."""
    module = next(k for k, v in HF_TARGETS.items() if v == t)
    full = f"model.layers.{layer}.{'mlp' if t in MLP_TARGETS else 'self_attn'}.{module}"
    for name, v in patterns.items():
        if full == name or full.endswith("." + name):
            return v
    return default


def _header(st_path: str, max_tensors: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of the safetensors file's entries, from its
    header alone: a regular file whose header length is within bounds, at
    most `max_tensors` entries (two per target per layer)."""
    from safetensors import SafetensorError, safe_open

    try:
        st = os.stat(st_path)
    except FileNotFoundError:
        raise ValueError(f"lora: {st_path} not found") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"lora: {st_path}: not a regular file; refusing to read it")
    if st.st_size < 10:
        raise ValueError(f"lora: {st_path}: not a safetensors file ({st.st_size} bytes)")
    try:
        fd = os.open(st_path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError(f"lora: {st_path}: not a regular file; refusing to read it")
            head = os.pread(fd, 8, 0)
        finally:
            os.close(fd)
    except OSError as e:
        raise ValueError(f"lora: {st_path}: cannot be read ({e.strerror or e})") from None
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or 8 + n > st.st_size:
        raise ValueError(
            f"lora: {st_path}: not a safetensors file (its {st.st_size} bytes hold no header)"
        )
    if n > MAX_HEADER_BYTES:
        raise ValueError(
            f"lora: {st_path}: a header of {n} bytes, over the "
            f"{MAX_HEADER_BYTES >> 20} MiB an adapter's needs"
        )
    try:
        with safe_open(st_path, framework="numpy") as f:
            names = list(f.keys())
            if len(names) > max_tensors:
                raise ValueError(
                    f"lora: {st_path}: {len(names)} tensors; an adapter of this "
                    f"model has at most {max_tensors}"
                )
            out = {}
            for name in names:
                s = f.get_slice(name)
                out[name] = (s.get_dtype(), tuple(int(x) for x in s.get_shape()))
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"lora: {st_path}: corrupt or unreadable safetensors file ({str(e)[:200]})"
        ) from None
    return out


def _factors(entries: dict, shapes: dict, L: int, max_rank: int, where: str) -> dict:
    """(layer, target) -> (rank, (lora_A name, lora_B name)), every entry's
    name, dtype and shape checked against the base model first."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name, (dtype, shape) in entries.items():
        m = _KEY.search(name)
        if m is None or m.group(2) not in HF_TARGETS:
            raise ValueError(
                f"{where}: tensor {_short(name)} targets a module jaxkv does not "
                f"apply LoRA to (only {sorted(HF_TARGETS)} of the decoder layers)"
            )
        layer, t = int(m.group(1)), HF_TARGETS[m.group(2)]
        if layer >= L:
            raise ValueError(f"{where}: {name!r} is for layer {layer}, the model has {L}")
        if t not in shapes:
            raise ValueError(
                f"{where}: {name!r}: this model's MLPs include mixtures of "
                "experts; jaxkv applies LoRA to its attention only"
            )
        if dtype not in _FLOATS:
            raise ValueError(
                f"{where}: tensor {name!r} is {dtype}; LoRA factors are F16, BF16, F32 or F64"
            )
        if len(shape) != 2:
            raise ValueError(
                f"{where}: tensor {name!r} has shape {list(shape)}; LoRA factors are matrices"
            )
        n_in, n_out = shapes[t]
        if (m.group(3) == "A" and shape[1] != n_in) or (m.group(3) == "B" and shape[0] != n_out):
            raise ValueError(
                f"{where}: layer {layer} {t}: lora_{m.group(3)} {list(shape)} does "
                f"not fit the base projection [{n_in} in, {n_out} out] (expected "
                f"[r, {n_in}] and [{n_out}, r])"
            )
        found.setdefault((layer, t), {})[m.group(3)] = name
    if not found:
        raise ValueError(f"{where}: no LoRA factors in {WEIGHTS}")
    out = {}
    for (layer, t), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {t}: lora_A and lora_B must both be present")
        (_, A), (_, B) = entries[ab["A"]], entries[ab["B"]]
        n_in, n_out = shapes[t]
        r = A[0]
        if A[1] != n_in or B != (n_out, r):
            raise ValueError(
                f"{where}: layer {layer} {t}: lora_A {list(A)} and lora_B "
                f"{list(B)} do not fit the base projection [{n_in} in, {n_out} "
                f"out] (expected [r, {n_in}] and [{n_out}, r])"
            )
        if r < 1:
            raise ValueError(f"{where}: layer {layer} {t}: rank 0 (lora_A {list(A)})")
        if r > max_rank:
            raise ValueError(f"{where}: rank {r} exceeds max_lora_rank {max_rank}")
        out[(layer, t)] = (r, (ab["A"], ab["B"]))
    return out


def _tensors(st_path: str, names: set[str]) -> dict[str, np.ndarray]:
    """The checked entries' data as float32."""
    from safetensors import SafetensorError, safe_open

    out = {}
    try:
        with safe_open(st_path, framework="numpy") as f:
            for name in names:
                out[name] = np.asarray(f.get_tensor(name), np.float32)
    except (SafetensorError, OSError) as e:
        raise ValueError(
            f"lora: {st_path}: corrupt or unreadable safetensors file ({str(e)[:200]})"
        ) from None
    return out


def _short(v, n: int = 80) -> str:
    """repr(v), at most about n characters (a field may hold megabytes)."""
    if isinstance(v, (dict, list)) and len(v) > 20:
        return f"<{type(v).__name__} of {len(v)} items>"
    s = repr(v)
    return s if len(s) <= n else s[:n] + f"... ({len(s)} characters)"
