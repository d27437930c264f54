"""Pieces of scripts/device/engine.py that import neither jax nor torch
at module level: the results file, its markdown table and the exit status,
model shapes and seeded workloads, and the Hugging Face side, run in its own
process (`python3 scripts/device/results.py --hf JOB RESULT`) so torch and
jax never share one (their CUDA libraries and memory pools stay apart)."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file

PARTS = ("attention", "e2e", "throughput", "profile")
H200_PEAK = 4.8e12  # B/s, vendor datasheet
NOMINAL_CPU_PEAK = 50e9  # B/s, a nominal figure for smoke runs, not measured

# HF-style shapes (LlamaConfig keywords); head dim 64 in all.
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
LLAMA_1B_SHAPE = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rope_theta=5e5,
    tie_word_embeddings=True,
)
TINY_THROUGHPUT_SHAPE = dict(
    TINY_SHAPE,
    hidden_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=256,
    tie_word_embeddings=True,
)


class Results:
    """DIR/device_check.json {"meta", "parts": {name: entry}}, rewritten per update."""

    def __init__(self, out_dir):
        self.path = Path(out_dir) / "device_check.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def load(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.is_file() else dict(meta={}, parts={})

    def update(self, part: str | None = None, entry: dict | None = None, **meta) -> None:
        data = self.load()
        data.setdefault("meta", {}).update(meta)
        if part is not None:
            data.setdefault("parts", {})[part] = entry
        self.path.with_suffix(".tmp").write_text(json.dumps(data, indent=1, default=str))
        os.replace(self.path.with_suffix(".tmp"), self.path)


def _fmt(x, spec=".3g"):
    return "" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def markdown(data: dict) -> str:
    """One row per part, then the side-by-side throughput table."""
    meta, parts = data.get("meta", {}), data.get("parts", {})
    lines = [
        f"# Device check ({meta.get('mode', '?')})",
        "",
        f"device: {meta.get('device', '?')}; jax {meta.get('jax', '?')}; "
        f"exit status {meta.get('exit_status', '?')}",
        "",
        "| part | status | check | summary |",
        "|---|---|---|---|",
    ]
    for name in PARTS:
        p = parts.get(name) or dict(status="failed", error="no result")
        err = p.get("error") and "error: " + p["error"].strip().splitlines()[-1][:200]
        text = "; ".join(x for x in (p.get("summary"), err, p.get("reason")) if x)
        lines.append(
            f"| {name} | {p.get('status')} | {_fmt(p.get('check'))} | {text.replace('|', '/')} |"
        )
    rows = (parts.get("throughput") or {}).get("rows") or []
    if rows:
        lines += [
            "",
            "## Throughput (same workload)",
            "",
            "| system | output tok/s | TTFT p50 s | TTFT p99 s | wall s | vs HF |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    for r in rows:
        note = r.get("unavailable") or ((r.get("error") or "").strip().splitlines() or [""])[-1]
        lines.append(
            f"| {r['system']} | {note[:150]} | | | | |"
            if note
            else f"| {r['system']} | {r['output_tok_s']:.1f} | {_fmt(r['ttft_p50_s'])} | "
            f"{_fmt(r['ttft_p99_s'])} | {r['wall_s']:.2f} | "
            f"{_fmt(r.get('ratio_vs_hf'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def exit_status(parts: dict) -> int:
    """2 if a correctness check failed, else 1 if any part failed, else 0."""
    e = [parts.get(n) or dict(status="failed") for n in PARTS]
    return (
        2
        if any(x.get("check") == "fail" for x in e)
        else int(any(x.get("status") == "failed" for x in e))
    )


def attention_entry(out, rc: int) -> dict:
    """Part 1, from bench_attention.json and bench_attention.py's exit status."""
    try:
        d = json.loads((Path(out) / "bench_attention.json").read_text())
    except (OSError, ValueError):
        return dict(status="failed", error=f"no bench_attention.json (exit status {rc})")
    corr = d.get("correctness") or []
    ok = sum(bool(c.get("ok")) for c in corr)
    dec = [r for r in d.get("decode", []) if "gb_s" in r]
    best = max(
        (r for r in dec if r["impl"].startswith("pallas-gpu")),
        key=lambda r: r["bw_fraction"],
        default=None,
    )
    text = f"{ok}/{len(corr)} kernel cases match the reference; {len(dec)} decode rows timed" + (
        f"; ours at best {best['bw_fraction']:.0%} of copy bw (B={best['batch']}, "
        f"ctx={best['context']})"
        if best
        else ""
    )
    check = None if not corr else ("pass" if ok == len(corr) else "fail")
    return dict(
        status="ok" if rc == 0 and check == "pass" else "failed",
        check=check,
        summary=text,
        errors=len(d.get("errors", [])),
        exit_status=rc,
        error=None
        if rc == 0
        else f"bench_attention.py exit status {rc}" + (" (timeout)" if rc in (124, 137) else ""),
    )


def summarize(out, rc_args) -> int:
    """Fold in part 1 and the exit statuses (PART=RC); write the markdown."""
    res, rcs = Results(out), dict(kv.split("=", 1) for kv in rc_args)
    parts = res.load().get("parts", {})
    for name in PARTS:
        if rcs.get(name) == "skip":  # left out with --parts
            res.update(name, dict(status="skipped", reason="not selected (--parts)"))
            parts[name] = dict(status="skipped")
            continue
        rc = int(rcs.get(name, -1))
        if name == "attention":
            parts[name] = attention_entry(out, rc)
        elif not parts.get(name) or parts[name].get("status") == "running":  # keeps its figures
            parts[name] = dict(
                parts.get(name) or {},
                status="failed",
                error=f"exit status {rc}"
                + (" (timeout)" if rc in (124, 137) else "")
                + "; see device_check_engine.log",
            )
        res.update(name, parts[name])
    res.update(exit_status=exit_status(parts))
    print(md := markdown(res.load()))
    (Path(out) / "device_check.md").write_text(md)
    return exit_status(parts)


def find_default_model(arg: str | None) -> tuple[Path | None, list[str]]:
    """--model, $JAXKV_TEST_GGUF, the cache's GGUF or checkpoint -> (path | None, looked at)."""
    from checkpoints.known_models import DEFAULT_MODEL, SMOLLM2_FILE
    from jaxkv.paths import cache_dir

    looked = []
    for cand in (
        arg,
        os.environ.get("JAXKV_TEST_GGUF"),
        cache_dir() / "downloads" / SMOLLM2_FILE,
        cache_dir() / "models" / DEFAULT_MODEL,
    ):
        if cand:
            looked.append(str(cand))
            if Path(cand).expanduser().exists():
                return Path(cand).expanduser(), looked
    return None, looked


def workload(n: int, prompt_range, output_range, vocab: int, seed: int):
    """n seeded requests: (prompt token id lists, output lengths)."""
    rng = np.random.default_rng(seed)
    p = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
    o = rng.integers(output_range[0], output_range[1] + 1, n)
    return [rng.integers(1, vocab, k).tolist() for k in p], o.tolist()


def rate_row(system: str, wall: float, tokens: int, ttft: list, **extra) -> dict:
    return dict(
        system=system,
        wall_s=wall,
        output_tokens=tokens,
        output_tok_s=tokens / wall,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p99_s=float(np.percentile(ttft, 99)),
        **extra,
    )


def run_hf_job(job: dict, timeout: float, log=None) -> dict:
    """Run `job` in a fresh python process (see _hf_main); its result dict."""
    with tempfile.TemporaryDirectory(prefix="device-check-hf-") as tmp:
        jf, rf = Path(tmp) / "job.json", Path(tmp) / "result.json"
        jf.write_text(json.dumps(job))
        proc = subprocess.run(
            [sys.executable, __file__, "--hf", str(jf), str(rf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
        if not rf.is_file():
            raise RuntimeError(f"HF worker exited {proc.returncode} without a result")
        res = json.loads(rf.read_text())
    if res.get("error"):
        raise RuntimeError("HF worker: " + res["error"])
    return res


def _random_hf_model(shape: dict, dtype, device, attn: str):
    """A LlamaForCausalLM whose logits are well apart (std 1/sqrt(fan in), unit
    embedding rows, norms near 1): greedy tokens not decided by rounding."""
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(
        **shape,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
                continue
            p.normal_(0.0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
    return model.to(device=device, dtype=dtype).eval()


def _hf_greedy(job: dict, dev) -> dict:
    """Plain greedy loops, a prompt at a time, float32, TF32 off, on job["model"]
    (GGUF or HF folder) or a random job["make"] saved to job["save_dir"] first."""
    import torch
    import transformers as tf

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if job.get("make"):
        model = _random_hf_model(job["make"], torch.float32, "cpu", "eager")
        model.save_pretrained(job["save_dir"], safe_serialization=True)
    else:
        path = Path(job["model"])
        model = tf.AutoModelForCausalLM.from_pretrained(
            str(path.parent if path.is_file() else path),
            dtype=torch.float32,
            attn_implementation="eager",
            **(dict(gguf_file=path.name) if path.is_file() else {}),
        )
    model = model.to(dev).eval()
    ck = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    tokens = []
    with torch.inference_mode():
        for ids in job["prompts"]:
            want, past, inp = [], None, torch.tensor([ids], device=dev)
            for _ in range(job["max_tokens"]):
                out = model(input_ids=inp, use_cache=True, **({} if past is None else {ck: past}))
                past = getattr(out, ck)
                want.append(int(out.logits[0, -1].argmax()))
                inp = torch.tensor([[want[-1]]], device=dev)
            tokens.append(want)
    return dict(tokens=tokens)


def _hf_generate(job: dict, dev) -> dict:
    """`generate` on batches of job["batch"] requests in order, left padded,
    each to its longest output. TTFT: from the start (all arrive then) to the
    first logits-processor call of the request's batch (device synchronized)."""
    import torch
    import transformers as tf

    model = _random_hf_model(job["shape"], getattr(torch, job["dtype"]), dev, job["attn"])
    model.generation_config.eos_token_id = None
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    first = []

    class FirstCall(tf.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not first:
                sync()
                first.append(time.perf_counter())
            return scores

    def gen(batch, new):
        first.clear()
        w = max(len(p) for p in batch)
        pad = [[0] * (w - len(p)) for p in batch]
        out = model.generate(
            input_ids=torch.tensor([z + p for z, p in zip(pad, batch)], device=dev),
            attention_mask=torch.tensor([z + [1] * len(p) for z, p in zip(pad, batch)], device=dev),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            logits_processor=tf.LogitsProcessorList([FirstCall()]),
        )
        sync()
        return (out.shape[1] - w) * len(batch)

    prompts, outs, B = job["prompts"], job["outputs"], job["batch"]
    with torch.inference_mode():
        gen(prompts[:2], 4)  # warm-up: kernels, cuBLAS handles
        t0 = time.perf_counter()
        ttft, done, computed = [], 0, 0
        while done < len(prompts) and time.perf_counter() < t0 + job["budget_s"]:
            batch = prompts[done : done + B]
            computed += gen(batch, max(outs[done : done + B]))
            ttft += [first[0] - t0] * len(batch)
            done += len(batch)
        wall = time.perf_counter() - t0
    return dict(
        wall_s=wall,
        requests=done,
        output_tokens=sum(outs[:done]),
        computed_tokens=computed,
        ttft_s=ttft,
        attn=model.config._attn_implementation,
    )


def _hf_main(job_file: str, result_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    try:
        import torch
        import transformers

        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        res = {"greedy": _hf_greedy, "generate": _hf_generate}[job["kind"]](job, dev)
        res.update(device=str(dev), torch=torch.__version__, transformers=transformers.__version__)
    except Exception:
        traceback.print_exc()
        res = dict(error=traceback.format_exc()[-3000:])
    Path(result_file).write_text(json.dumps(res))


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "--hf":
        sys.exit("usage: device_check_lib.py --hf JOB.json RESULT.json")
    _hf_main(sys.argv[2], sys.argv[3])
