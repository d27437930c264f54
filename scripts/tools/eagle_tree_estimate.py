"""Would a token tree pay where the engine's EAGLE-3 chain does not? An
offline estimate on a head trained by `jaxkv train-draft`, over the
held-out answers it recorded (HEAD/data/heldout.npz).

    python scripts/tools/eagle_tree_estimate.py HEAD [--model smollm2-135m-instruct]
        [--max-tokens 192] [--json out.json]

A tree is given by its branching per depth: (1, 1, 1, 1) is the chain of
k = 4 the engine runs, (2, 1, 1, 1) two chains from the head's two best
first tokens, (2, 2, 1, 1) four, and so on; it has sum over depths of
the product of the branchings so far proposal rows. Depth j of a step
accepts when the target's greedy token there is among the head's top b_j
at that depth, reading the sequence's own earlier tokens (along the
accepted path those are what the tree holds), and every shallower depth
accepted. Steps walk the answers as the engine does
(`draft_data.per_step_length`: each step starts where the last ended), so
the chain's figure is the one the engine measures. The verify cost of a
tree's rows is the engine's to measure (`scripts/bench/spec.py --eagle
HEAD --k R` gives a step of 1 + R rows); this script gives the accepted
length each shape would have to pay for. Last, a hybrid of the same rows
as the chain: prompt lookup's tokens where it finds a match, else the
head's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file


SHAPES = [
    (1,),
    (1, 1),
    (1, 1, 1),
    (1, 1, 1, 1),
    (1,) * 6,
    (1,) * 8,
    (2, 1, 1, 1),
    (3, 1, 1, 1),
    (4, 1, 1, 1),
    (2, 2, 1, 1),
    (2, 2, 2, 1),
    (4, 2, 1, 1),
]


def ranks(head: str, target: str, max_tokens: int, depth: int):
    """[B, T, depth] rank of the target's token among the head's draft
    logits at each anchor and depth (a large number where it cannot be
    proposed), [B, T] the anchors, and the recorded data (cut to
    `max_tokens` of answer)."""
    import jax
    import jax.numpy as jnp

    from checkpoints.eagle3 import load_eagle3
    from checkpoints.loader import load_model
    from jaxkv.model import eagle as head_ops
    from jaxkv.training.draft_data import draft_index, take
    from jaxkv.training.trainer import chain_targets

    model, _ = load_model(target)
    cfg, params = load_eagle3(head, model.config)
    with np.load(Path(head) / "data" / "heldout.npz") as z:
        data = {k: z[k] for k in z.files if k != "stamp"}
    T = data["mask"].shape[1]
    data["mask"] = data["mask"] & (np.arange(T)[None] < data["start"][:, None] + max_tokens)
    embed = jnp.asarray(params["embed"] if "embed" in params else head_ops.target_embed(model))
    t2d = jnp.asarray(draft_index(np.asarray(params["d2t"]), cfg.vocab_size))
    p = {k: jnp.asarray(v) for k, v in params.items()}

    @jax.jit
    def one(b):
        logits = head_ops.unrolled_logits(cfg, p, embed, b["feats"], b["tokens"], b["mask"], depth)
        lab, ok, anchors = chain_targets(b, t2d, depth)
        mine = jnp.take_along_axis(logits, jnp.maximum(lab, 0)[..., None], axis=-1)
        r = (logits > mine).sum(-1)
        return jnp.where(ok & b["mask"][None], r, 1 << 20).transpose(1, 2, 0), anchors

    rows = [one(take(data, np.asarray([i]))) for i in range(len(data["tokens"]))]
    return (
        np.stack([np.asarray(r[0]) for r, _ in rows]),
        np.stack([np.asarray(a[0]) for _, a in rows]),
        data,
    )


def tree_lengths(ranks_, anchors, shape) -> np.ndarray:
    """[B, T] each anchor's accepted length under `shape` (0 elsewhere)."""
    hit = ranks_[..., : len(shape)] < np.asarray(shape)
    return np.where(anchors, 1 + np.cumprod(hit, axis=-1).sum(-1), 0)


def estimate(ranks_, anchors, shape) -> dict:
    from jaxkv.training.draft_data import per_step_length

    acc, drafts = per_step_length(tree_lengths(ranks_, anchors, shape))
    return {
        "shape": list(shape),
        "rows": int(sum(np.prod(shape[: j + 1]) for j in range(len(shape)))),
        "mean_accepted_length": 1 + acc / max(drafts, 1),
    }


def with_lookup(ranks_, anchors, data, k: int = 4, n_max: int = 4, n_min: int = 2) -> dict:
    """The chain of k, except where prompt lookup (n = n_max..n_min) finds
    a match: there its k tokens (a hybrid proposer; k rows either way)."""
    from jaxkv.core.spec.decode import ngram_lookup
    from jaxkv.training.draft_data import per_step_length

    lengths, matched = tree_lengths(ranks_, anchors, (1,) * k), []
    for i, row in enumerate(lengths):
        toks, end = data["tokens"][i], int(data["mask"][i].sum())
        for t in np.flatnonzero(anchors[i]):
            prop = ngram_lookup(np.asarray(toks[: t + 2]), k, n_max, n_min)
            matched.append(bool(prop))
            if prop:
                n = 0
                while n < len(prop) and t + 2 + n < end and toks[t + 2 + n] == prop[n]:
                    n += 1
                row[t] = 1 + n
    acc, drafts = per_step_length(lengths)
    return {
        "shape": f"prompt lookup (n = {n_max}..{n_min}) where it matches, else chain of {k}",
        "rows": k,
        "mean_accepted_length": 1 + acc / max(drafts, 1),
        "lookup_matches": float(np.mean(matched)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("head")
    p.add_argument("--model", default="smollm2-135m-instruct", help="the head's target")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    ranks_, anchors, data = ranks(a.head, a.model, a.max_tokens, max(len(s) for s in SHAPES))
    res = [estimate(ranks_, anchors, s) for s in SHAPES]
    res.append(with_lookup(ranks_, anchors, data))
    print("| branching per depth | proposal rows | mean accepted length |\n|---|---:|---:|")
    for r in res:
        shape = r["shape"] if isinstance(r["shape"], str) else tuple(r["shape"])
        print(f"| {shape} | {r['rows']} | {r['mean_accepted_length']:.2f} |")
    if a.json:
        Path(a.json).write_text(
            json.dumps({"head": a.head, "max_tokens": a.max_tokens, "shapes": res}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
