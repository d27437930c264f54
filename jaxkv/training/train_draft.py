"""`jaxkv train-draft`: train an EAGLE-3 draft head for a model by
self-distillation, with optax, checkpointed with orbax.

    jaxkv train-draft --model M --data prompts.jsonl --out DIR [--steps N] [--held-out FILE]

1. The engine answers the prompts greedily: the target's own outputs are
   the data (no data set from elsewhere is needed, and the head learns the
   very distribution it will be verified against).
2. One pass of the target over each prompt + answer records what the head
   reads (the features of its three layers, `Llama.aux_layers`) and what
   it must predict (the target's greedy token at every position).
3. The head starts as a copier (`draft_trainer.induction_init`: its
   attention looks up where the given token occurred before and writes
   what followed, as n-gram lookup does) and trains on the engine's own
   unrolled computation
   (`jaxkv.model.eagle.unrolled_logits`, EAGLE-3's training-time test):
   cross-entropy of each of k chained steps against the target's token,
   weighted 0.8**j, under AdamW with warm-up and cosine decay and gradient
   clipping. The draft vocabulary is the `--draft-vocab` tokens the target
   produces most often (`d2t` maps them back).
4. Every `--save-every` steps an orbax checkpoint (parameters, optimizer
   state, step) lets a killed run resume where it stopped, on the same data
   (kept in DIR/data); at the end the head is written to DIR in the Hugging
   Face layout (`checkpoints.eagle3`), which `speculative_config={"method":
   "eagle3", "model": DIR}` loads.

The progress bar shows the loss and, every `--eval-every` steps, the mean
accepted length on the held-out prompts as the engine measures it: greedy
decoding with k proposals a step, each step 1 + the number of chained
proposals that equal the target's greedy tokens before the first that
does not, the next step starting where that one ended
(`draft_data.per_step_length`). The history in DIR/train_summary.json
also keeps the mean over every position (`accept`), which counts the
stretches a step would jump over once per position and so reads higher.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxkv.model import eagle as head_ops
from jaxkv.training.draft_data import answer, choose_vocab, read_prompts, target_features
from jaxkv.training.trainer import init_params, train

log = logging.getLogger("jaxkv")


def add_command(sub) -> None:
    t = sub.add_parser(
        "train-draft",
        help="train an EAGLE-3 draft head for a model (self-distillation)",
        description="The model answers the prompts greedily; a draft head learns to predict "
        "its tokens from its hidden states (optax; orbax checkpoints in OUT/ckpt, "
        "so a killed run resumes). The head is written to OUT in the Hugging Face "
        "EAGLE-3 layout: serve it with --speculative-config "
        '\'{"method": "eagle3", "model": "OUT"}\'.',
    )
    t.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="the target model: name or path (default: %(default)s)",
    )
    t.add_argument(
        "--data",
        required=True,
        help='prompts, JSONL: {"prompt": ...} or '
        '{"messages": [...]} per line (the repo ships data/draft_prompts/train.jsonl)',
    )
    t.add_argument(
        "--limit", type=int, default=None, help="use the first LIMIT prompts of --data only"
    )
    t.add_argument("--held-out", default=None, help="prompts for the held-out acceptance length")
    t.add_argument("--out", required=True, help="folder for the head (and ckpt/, data/)")
    t.add_argument("--steps", type=int, default=400, help="optimizer steps (default: %(default)s)")
    t.add_argument(
        "--batch-size", type=int, default=8, help="sequences per step (default: %(default)s)"
    )
    t.add_argument(
        "--lr", type=float, default=1e-3, help="peak learning rate (default: %(default)s)"
    )
    t.add_argument(
        "--chain",
        type=int,
        default=4,
        help="chained proposals trained per position, k (default: %(default)s)",
    )
    t.add_argument(
        "--draft-vocab",
        type=int,
        default=8192,
        help="draft vocabulary: the target's most frequent tokens (default: %(default)s)",
    )
    t.add_argument(
        "--max-tokens",
        type=int,
        default=192,
        help="longest answer generated per prompt (default: %(default)s)",
    )
    t.add_argument(
        "--length",
        type=int,
        default=256,
        help="rows per training sequence, prompt + answer (default: %(default)s)",
    )
    t.add_argument(
        "--init",
        choices=("copy", "random"),
        default="copy",
        help="the head's start: its attention a copier of earlier continuations "
        "(induction_init), or random (default: %(default)s)",
    )
    t.add_argument(
        "--train-output",
        action="store_true",
        help="train the head's output rows too (by default they stay the target's "
        "own, over the draft vocabulary: better held out and faster on little "
        "data)",
    )
    t.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    t.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("-v", "--verbose", action="store_true", help="log engine set-up and phases")
    t.set_defaults(func=cmd_train_draft)


def _dataset(engine, tok, model, prompts, aux, args, path: Path) -> dict:
    """The prompts answered and passed through the target, kept in `path`
    (a resumed run reads it back; one recorded for other prompts or
    options is refused)."""
    import hashlib

    what = json.dumps([args.model, prompts, args.max_tokens, args.length, list(aux)])
    stamp = np.frombuffer(hashlib.sha256(what.encode()).digest(), np.uint8)
    if path.is_file():
        with np.load(path) as z:
            data = {k: z[k] for k in z.files}
        if not np.array_equal(data.pop("stamp", None), stamp):
            raise ValueError(
                f"{path}: recorded for other prompts or options (--model, --data, "
                f"--limit, --max-tokens, --length); give a fresh --out"
            )
        return data
    t0 = time.perf_counter()
    seqs, starts = answer(engine, tok, prompts, args.max_tokens)
    data = target_features(model, seqs, aux, args.length, starts=starts)
    log.info(
        "jaxkv train-draft: %d sequences answered and recorded in %.0f s (%s)",
        len(seqs),
        time.perf_counter() - t0,
        path.name,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(str(path) + ".tmp.npz", stamp=stamp, **data)
    os.replace(str(path) + ".tmp.npz", path)
    return data


def cmd_train_draft(a) -> int:
    from checkpoints.eagle3 import save_eagle3
    from checkpoints.loader import load_model
    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine
    from jaxkv.model.eagle import target_embed as _target_embed

    t0 = time.perf_counter()
    out = Path(a.out)
    prompts = read_prompts(a.data)[: a.limit]
    held = read_prompts(a.held_out) if a.held_out else None
    model, tok = load_model(a.model)
    cfg = head_ops.Eagle3Config.for_target(model.config, a.draft_vocab)
    aux = cfg.aux_layers
    engine = LLMEngine(model, tok, EngineConfig(warmup=False, max_num_seqs=128))
    data = _dataset(engine, tok, model, prompts, aux, a, out / "data" / "train.npz")
    heldout = (
        _dataset(engine, tok, model, held, aux, a, out / "data" / "heldout.npz") if held else None
    )
    meta = out / "data" / "vocab.npy"
    if meta.is_file():
        d2t = np.load(meta)
    else:
        d2t = choose_vocab(
            data["labels"],
            data["mask"],
            cfg.vocab_size,
            a.draft_vocab,
            always=model.config.eos_token_ids,
        )
        np.save(meta, d2t)
    import dataclasses

    cfg = dataclasses.replace(cfg, draft_vocab_size=len(d2t))
    embed = _target_embed(model)
    params = init_params(cfg, model, d2t, a.seed, data=data if a.init == "copy" else None)
    tr, history = train(
        cfg,
        params,
        embed,
        data,
        steps=a.steps,
        batch_size=a.batch_size,
        seed=a.seed,
        heldout=heldout,
        eval_every=a.eval_every,
        ckpt_dir=out / "ckpt",
        save_every=a.save_every,
        lr=a.lr,
        chain=a.chain,
        freeze=() if a.train_output else ("lm_head",),
    )
    save_eagle3(out, cfg, tr.params())
    tr.close()
    summary = {
        "steps": tr.step,
        "seconds": round(time.perf_counter() - t0, 1),
        "sequences": int(len(data["tokens"])),
        "draft_vocab_size": cfg.draft_vocab_size,
        "held_out": history,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in summary.items() if k != "held_out"}
            | ({"held_out_last": history[-1]} if history else {})
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxkv train-draft")
    sub = p.add_subparsers(dest="command", required=True)
    add_command(sub)
    a = p.parse_args(["train-draft", *(argv or [])])
    return a.func(a)


if __name__ == "__main__":
    raise SystemExit(main())
