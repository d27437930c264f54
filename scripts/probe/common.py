"""Shared parts of the adversarial probe (scripts/probe/__main__.py): the tally of
outcomes and the tiny random model it probes.

Outcomes, one per probe:
  served   a control (ordinary) request answered, equal to its lone run
  named    a hostile input refused with an error that names the problem
  unnamed  refused, but the message does not say what was wrong
  wrong    a control answered, but not as its lone run answers
  crashes  the process, the engine or the handler died (a 500, a traceback)
  lost     submitted and never answered, neither output nor error
  hangs    no answer within the probe's time bound
  memory   over the probe's memory bound
Every outcome but served and named is bad; the probe exits 1 on any."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GOOD = ("served", "named")
BAD = ("unnamed", "wrong", "crashes", "lost", "hangs", "memory")


@dataclass
class Tally:
    """Counts of outcomes by part, and a line for each bad one."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, part: str, outcome: str, case: str = "", detail: str = "") -> None:
        if outcome not in GOOD + BAD:
            raise ValueError(f"outcome: {outcome!r}")
        row = self.counts.setdefault(part, {k: 0 for k in GOOD + BAD})
        row[outcome] += 1
        if outcome in BAD:
            self.failures.append(f"{part}/{case}: {outcome}: {detail[:300]}")

    def bad(self) -> int:
        return sum(row[k] for row in self.counts.values() for k in BAD)

    def table(self) -> str:
        head = "| part | probes | " + " | ".join(GOOD + BAD) + " | s |"
        lines = [head, "|---" * (len(GOOD + BAD) + 3) + "|"]
        total = {k: 0 for k in GOOD + BAD}
        for part, row in self.counts.items():
            for k in total:
                total[k] += row[k]
            lines.append(
                f"| {part} | {sum(row.values())} | "
                + " | ".join(str(row[k]) for k in GOOD + BAD)
                + f" | {self.seconds.get(part, 0):.0f} |"
            )
        lines.append(
            f"| all | {sum(total.values())} | "
            + " | ".join(str(total[k]) for k in GOOD + BAD)
            + f" | {sum(self.seconds.values()):.0f} |"
        )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {"counts": self.counts, "failures": self.failures, "seconds": self.seconds}
        )


class timed:
    """`with timed(tally, part):` records the part's wall seconds."""

    def __init__(self, tally: Tally, part: str):
        self.tally, self.part = tally, part

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.tally.seconds[self.part] = (
            self.tally.seconds.get(self.part, 0.0) + time.perf_counter() - self.t0
        )
        return False


def make_tiny_model(path: Path) -> Path:
    """A random 2-layer llama with SmolLM2's tokenizer (its real vocabulary and
    chat template, so prompts are ordinary text), saved as a jaxkv checkpoint
    at `path`. Only the public loaders are used."""
    from checkpoints import load_checkpoint
    from checkpoints.jaxkv_format import save
    from checkpoints.known_models import fetch_smollm2_gguf
    from jaxkv.config import ModelConfig
    from jaxkv.model.params import expected_shapes

    if path.exists():
        return path
    real, _, tokenizer = load_checkpoint(fetch_smollm2_gguf())
    config = ModelConfig(
        architecture="llama",
        vocab_size=real.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        eos_token_ids=real.eos_token_ids,
        bos_token_id=real.bos_token_id,
    )
    rng = np.random.default_rng(0)
    params = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm"):
            params[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            fan_in = shape[0] * (shape[1] if name.endswith(".wo") else 1) if len(shape) > 1 else 1
            std = 0.5 if name == "embed" else 1.0 / np.sqrt(fan_in)
            params[name] = (std * rng.standard_normal(shape)).astype(np.float32)
    return save(path, config, params, tokenizer)
