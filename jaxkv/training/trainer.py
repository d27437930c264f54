"""Training an EAGLE-3 head (`jaxkv train-draft`, `jaxkv.training.train_draft`):
the objective on the engine's own unrolled computation
(`jaxkv.model.eagle.unrolled_logits`, EAGLE-3's training-time test), optax's
AdamW with warm-up, cosine decay and clipping, orbax checkpoints from which
a killed run resumes to the same state (each step's batch is a function of
the step), and the held-out mean accepted length."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.model import eagle as head_ops
from jaxkv.training.draft_data import batch_indices, draft_index, per_step_length, take

LOSS_DECAY = 0.8  # weight of chained step j: LOSS_DECAY ** j


def init_params(
    cfg: head_ops.Eagle3Config, model, d2t: np.ndarray, seed: int = 0, data: dict | None = None
) -> dict:
    """Random head weights whose final norm and output rows start as the
    target's own (for the draft vocabulary): the head's hidden state lives
    in the target's residual space, and it starts from the target's
    reading of it. With recorded `data`, its attention also starts as a
    copier (`induction_init`)."""
    from jaxkv.model.eagle import target_embed, target_head

    p = head_ops.random_params(cfg, seed, d2t=d2t)
    p["final_norm"] = np.asarray(model.final_norm[...], np.float32) + model.config.norm_offset
    p["lm_head"] = np.ascontiguousarray(
        target_head(model)[:, np.arange(cfg.draft_vocab_size) + np.asarray(d2t)]
    )
    if data is not None:
        p = induction_init(cfg, p, target_embed(model), data, seed)
    return p


def _rms_rows(x) -> np.ndarray:
    """Rows scaled to root-mean-square 1 (float64)."""
    x = np.asarray(x, np.float64)
    return x / (np.sqrt((x * x).mean(-1, keepdims=True)) + 1e-12)


def _ridge(x, y, ridge: float = 1e-3) -> np.ndarray:
    """The least-squares map W with x @ W ~ y, ridge-regularized relative
    to x's mean square (float64 in, float32 out)."""
    x = np.asarray(x, np.float64)
    gram = x.T @ x
    gram += ridge * np.trace(gram) / len(gram) * np.eye(len(gram))
    return np.linalg.solve(gram, x.T @ y).astype(np.float32)


def token_probe(feats: np.ndarray, tokens: np.ndarray, embed: np.ndarray) -> np.ndarray:
    """A ridge-regression map [Et, E] from the target's lowest feature layer
    at a row to the (RMS-normalized) embedding of that row's token: the
    token a key position holds, which the target's features carry but not
    along the embedding's own direction."""
    return _ridge(feats, _rms_rows(embed[tokens]))


def induction_init(
    cfg: head_ops.Eagle3Config,
    p: dict,
    embed: np.ndarray,
    data: dict,
    seed: int = 0,
    *,
    q_gain: float = 2.0,
    v_gain: float = 30.0,
    probe_gain: float = 3.0,
    rows: int = 40_000,
) -> dict:
    """Start the head's attention as a copier (in the spirit of n-gram
    lookup): a query reading token x (the token it was given) attends to
    the earlier positions that hold x and writes the token that followed
    there into the residual, where the output rows (the target's) read it.
    A random head does not find this circuit in a short run on little
    data; started with it, the head learns around it.

    - fc: zero, but for `token_probe` of the lowest feature layer into a
      subspace R (so a key position's hidden state names its token);
    - q / k: the token embedding (q) and the hidden state (k), both
      through R, on the lowest-frequency rotary pairs of each head (near
      position-free over thousands of rows);
    - v / wo: the token embedding through another subspace and back,
      then to the direction the output rows read as that token (a least-
      squares map from embeddings to output rows over the draft
      vocabulary: about the identity where the target ties them).
    Other weights keep their random start (wo's other heads at zero)."""
    E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    Et, G, half = cfg.target_hidden_size, H // K, D // 2
    n = max(1, (3 * half) // 8)  # the lowest-frequency rotary pairs used
    dims = np.r_[np.arange(half - n, half), np.arange(D - n, D)]
    rng = np.random.default_rng([seed, 31])

    def basis(per_head: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """Orthonormal columns [E, <= E], and `per_head` of them for each
        KV head (reused in turn where the heads need more than E)."""
        q = np.linalg.qr(rng.standard_normal((E, min(K * per_head, E))))[0].astype(np.float32)
        return q, [q[:, (g * per_head + np.arange(per_head)) % q.shape[1]] for g in range(K)]

    (R, Rs), (_, Rvs) = basis(len(dims)), basis(D)
    m = np.asarray(data["mask"], bool)
    feats = np.asarray(data["feats"])[m][:rows, :Et]
    probe = token_probe(feats, np.asarray(data["tokens"])[m][:rows], embed)
    vocab = np.arange(cfg.draft_vocab_size) + np.asarray(p["d2t"])
    to_out = _ridge(_rms_rows(embed[vocab]), _rms_rows(np.asarray(p["lm_head"]).T))
    p = dict(p)
    fc = np.zeros((3 * Et, E), np.float32)
    fc[:Et] = probe_gain * probe @ R @ R.T
    p["fc"] = fc
    wqkv = np.array(p["wqkv"], np.float32)
    wo = np.zeros((H * D, E), np.float32)
    for g, (Rg, Rv) in enumerate(zip(Rs, Rvs)):
        kc = H * D + g * D + dims
        wqkv[:, kc] = 0.0
        wqkv[E:, kc] = q_gain * Rg  # keys: the hidden state's token
        for j in range(G):
            qc = (g * G + j) * D + dims
            wqkv[:, qc] = 0.0
            wqkv[:E, qc] = q_gain * Rg  # queries: the given token
        vc = (H + K) * D + g * D + np.arange(D)
        wqkv[:, vc] = 0.0
        wqkv[:E, vc] = Rv  # values: the token after the key's
        wo[g * G * D : (g * G + 1) * D] = v_gain * Rv.T @ to_out
    p["wqkv"], p["wo"] = wqkv, wo
    return p


def chain_targets(batch, t2d, steps: int):
    """Labels [steps, B, T] in draft ids, where they count [steps, B, T],
    and the anchors whose proposals are scored [B, T]. Step j at anchor t
    reads token t + j + 1 and predicts the target's token after it
    (labels[t + j + 1]); a label outside the draft vocabulary counts as
    a miss. Anchors: rows from the last prompt token on (where decoding
    proposes) with a next row."""
    labels, mask = batch["labels"], batch["mask"]
    B, T = labels.shape
    shift = (
        lambda x, n: jnp.concatenate(  # noqa: E731
            [x[:, n:], jnp.zeros((B, n), x.dtype)], axis=1
        )
    )
    lab = jnp.stack([t2d[shift(labels, j + 1)] for j in range(steps)])
    real = jnp.stack([shift(mask, j + 1) for j in range(steps)])
    anchors = real[0] & (jnp.arange(T)[None, :] >= batch["start"][:, None] - 1)
    return lab, real & (lab >= 0), anchors


def loss_and_metrics(trainable, frozen, batch, cfg, steps: int):
    """(weighted cross-entropy, {"loss", "accept", "lengths"}): `accept`
    is the mean accepted length of k = `steps` greedy proposals over the
    anchors, `lengths` each anchor's (`per_step_length` walks them)."""
    params = {**trainable, **frozen["params"]}
    feats = batch["feats"].astype(params["fc"].dtype)
    logits = head_ops.unrolled_logits(
        cfg, params, frozen["embed"], feats, batch["tokens"], batch["mask"], steps
    )  # [J, B, T, Vd]
    labels, ok, anchors = chain_targets(batch, frozen["t2d"], steps)
    ok = ok & batch["mask"][None]
    lp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(lp, jnp.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    w = LOSS_DECAY ** jnp.arange(steps, dtype=jnp.float32)
    per_step = (nll * ok).sum((1, 2)) / jnp.maximum(ok.sum((1, 2)), 1)
    loss = (w * per_step).sum() / w.sum()
    hit = (jnp.argmax(logits, -1) == labels) & ok  # a label outside the vocabulary: a miss
    run = jnp.cumprod(hit.astype(jnp.int32), axis=0)  # accepted while every earlier one was
    accept = 1 + (run * anchors[None]).sum() / jnp.maximum(anchors.sum(), 1)
    lengths = jnp.where(anchors, 1 + run.sum(0), 0)  # [B, T]: each anchor's, 0 elsewhere
    return loss, {"loss": loss, "accept": accept, "lengths": lengths}


class Trainer:
    """The optimizer, the jitted step and evaluation, and the orbax
    checkpoints of one training run. `freeze`: parameters kept as given
    (`jaxkv train-draft` keeps the output rows, the target's own)."""

    def __init__(
        self,
        cfg: head_ops.Eagle3Config,
        params: dict,
        embed,
        *,
        steps: int,
        lr: float = 1e-3,
        warmup: int | None = None,
        clip: float = 0.5,
        weight_decay: float = 0.0,
        chain: int = 4,
        ckpt_dir: str | os.PathLike | None = None,
        save_every: int = 50,
        freeze: tuple[str, ...] = (),
    ):
        import optax

        self.cfg = cfg
        self.chain = chain
        self.steps = steps
        fixed = ("d2t", "embed", *freeze)
        trainable = {k: jnp.asarray(v) for k, v in params.items() if k not in fixed}
        self.frozen = {
            "params": {k: jnp.asarray(params[k]) for k in ("d2t", *freeze)},
            "embed": jnp.asarray(params["embed"] if "embed" in params else embed),
            "t2d": jnp.asarray(draft_index(np.asarray(params["d2t"]), cfg.vocab_size)),
        }
        warmup = max(1, steps // 20) if warmup is None else warmup
        schedule = optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup, max(steps, warmup + 1), end_value=lr * 0.05
        )
        self.opt = optax.chain(
            optax.clip_by_global_norm(clip), optax.adamw(schedule, weight_decay=weight_decay)
        )
        self.state = {
            "params": trainable,
            "opt": self.opt.init(trainable),
            "step": jnp.zeros((), jnp.int32),
        }
        self._manager = None
        self.save_every = save_every
        if ckpt_dir is not None:
            import orbax.checkpoint as ocp

            self._manager = ocp.CheckpointManager(
                Path(ckpt_dir).absolute(),
                options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=save_every),
            )
        opt, frozen = self.opt, self.frozen

        def train_step(state, batch):
            grad_fn = jax.value_and_grad(loss_and_metrics, has_aux=True)
            (_, metrics), grads = grad_fn(state["params"], frozen, batch, cfg, chain)
            metrics = {k: metrics[k] for k in ("loss", "accept")}  # not the eval's lengths
            updates, new_opt = opt.update(grads, state["opt"], state["params"])
            return {
                "params": optax.apply_updates(state["params"], updates),
                "opt": new_opt,
                "step": state["step"] + 1,
            }, metrics

        self._step = jax.jit(train_step, donate_argnums=(0,))
        self._eval = jax.jit(lambda p, b: loss_and_metrics(p, frozen, b, cfg, chain)[1])

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def restore(self) -> bool:
        """Resume from the newest checkpoint, if any: True when restored."""
        import orbax.checkpoint as ocp

        if self._manager is None or self._manager.latest_step() is None:
            return False
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, self.state)
        try:
            state = self._manager.restore(
                self._manager.latest_step(), args=ocp.args.StandardRestore(abstract)
            )
        except (ValueError, KeyError, TypeError):
            state = None
        if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(self.state):
            self.close()
            raise ValueError(
                f"{self._manager.directory}: the checkpoint does not hold this run's "
                f"trained parameters ({', '.join(sorted(self.state['params']))}): "
                f"written with other options (--train-output, --draft-vocab, the "
                f"model); give a fresh --out"
            )
        self.state = state
        return True

    def save(self, force: bool = False) -> None:
        import orbax.checkpoint as ocp

        if self._manager is not None and self._manager.latest_step() != self.step:
            self._manager.save(self.step, args=ocp.args.StandardSave(self.state), force=force)
            self._manager.wait_until_finished()

    def train_step(self, batch) -> dict:
        self.state, metrics = self._step(self.state, batch)
        if self._manager is not None and self.step % self.save_every == 0:
            self.save()
        return metrics

    def evaluate(self, data: dict, batch_size: int = 8) -> dict:
        """Mean loss and accepted length over `data` (weighted by anchors),
        and `per_step`: the mean accepted length greedy decoding would
        measure in the engine (`per_step_length`)."""
        tot = {"loss": 0.0, "accept": 0.0}
        n = accepted = drafts = 0
        N = len(data["tokens"])
        for i in range(0, N, batch_size):
            idx = np.arange(i, min(i + batch_size, N))
            idx = np.concatenate([idx, np.full(batch_size - len(idx), idx[-1])])
            b = take(data, idx)
            w = float(np.asarray(b["mask"])[: len(idx)].sum())
            m = self._eval(self.state["params"], b)
            tot = {k: tot[k] + w * float(m[k]) for k in tot}
            a, d = per_step_length(np.asarray(m["lengths"])[: min(batch_size, N - i)])
            n, accepted, drafts = n + w, accepted + a, drafts + d
        return {
            **{k: v / max(n, 1) for k, v in tot.items()},
            "per_step": 1 + accepted / max(drafts, 1),
        }

    def params(self) -> dict:
        return {
            **{k: np.asarray(v) for k, v in self.state["params"].items()},
            **{k: np.asarray(v) for k, v in self.frozen["params"].items()},
        }

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()


def train(
    cfg: head_ops.Eagle3Config,
    params: dict,
    embed,
    data: dict,
    *,
    steps: int,
    batch_size: int = 8,
    seed: int = 0,
    heldout: dict | None = None,
    eval_every: int = 50,
    ckpt_dir=None,
    save_every: int = 50,
    stop_after: int | None = None,
    progress=True,
    **opt,
) -> tuple[Trainer, list[dict]]:
    """Train (or resume) to `steps`; returns the trainer and the history of
    evaluations. `stop_after`: stop at that step (as a killed run would)."""
    from tqdm.auto import tqdm

    tr = Trainer(cfg, params, embed, steps=steps, ckpt_dir=ckpt_dir, save_every=save_every, **opt)
    tr.restore()
    history = []
    N = len(data["tokens"])
    bar = tqdm(
        total=steps,
        initial=tr.step,
        desc="train-draft",
        unit="step",
        dynamic_ncols=True,
        disable=not progress,
    )
    last = stop_after if stop_after is not None else steps
    while tr.step < min(steps, last):
        metrics = tr.train_step(take(data, batch_indices(N, batch_size, tr.step, seed)))
        post = {
            "loss": f"{float(metrics['loss']):.3f}",
            "accept": f"{float(metrics['accept']):.2f}",
        }
        if heldout is not None and (tr.step % eval_every == 0 or tr.step == steps):
            ev = tr.evaluate(heldout, batch_size)
            history.append({"step": tr.step, **ev})
            post["held-out per step"] = f"{ev['per_step']:.2f}"
        bar.set_postfix(post, refresh=False)
        bar.update(1)
    bar.close()
    if tr.step == steps:
        tr.save(force=True)
    return tr, history
