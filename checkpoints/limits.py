"""Checks that refuse a hostile checkpoint before it can cost memory: the
config's layer count against the layers whose tensors exist, and the
tokenizer's ids against the model's vocabulary. (Side files are read by
`jaxkv.tokenizer.read_regular_file`: regular files only, size bounded.)"""

from __future__ import annotations

from collections.abc import Iterable

from jaxkv.config import ModelConfig
from jaxkv.tokenizer import Tokenizer


def check_layer_count(num_layers: int, names: Iterable[str], prefix: str, field: str) -> None:
    """Raise ValueError naming `field` unless the tensor names under
    ``{prefix}{i}.`` cover exactly the layers 0 .. num_layers - 1.

    Run before anything builds per-layer lists from the config (e.g.
    `jaxkv.model.params.expected_shapes`), so a 1 MB checkpoint that claims
    10^9 layers is refused at once instead of listing 10^10 expected
    tensors; the lists are then never longer than the tensors present."""
    found = set()
    for name in names:
        if name.startswith(prefix):
            head = name[len(prefix) :].split(".", 1)[0]
            if head.isdigit():
                found.add(int(head))
    n = len(found)
    if found != set(range(n)):
        gap = min(set(range(n)) - found)
        raise ValueError(
            f"{field}: the checkpoint's layer tensors are not numbered 0 to {n - 1} "
            f"(none for layer {gap})"
        )
    if num_layers != n:
        have = f"{n} (layers 0 to {n - 1})" if n else "no layer"
        raise ValueError(
            f"{field}: {num_layers} layers claimed, but the checkpoint has tensors for {have}"
        )


def check_tokenizer_fits(config: ModelConfig, tokenizer: Tokenizer | None) -> None:
    """Raise ValueError when the tokenizer can produce ids the model has no
    embedding row for (largest id + 1 above ``config.vocab_size``); a
    smaller tokenizer is fine (models pad their vocabulary)."""
    if tokenizer is not None and (n := tokenizer.num_ids) > config.vocab_size:
        raise ValueError(
            f"tokenizer: {n} token ids (largest {n - 1}), more than the model's "
            f"vocab_size {config.vocab_size}"
        )
