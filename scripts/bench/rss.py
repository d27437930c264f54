"""Peak resident memory of one prompt, jaxkv beside Hugging Face transformers:
`jaxkv generate PROMPT --max-tokens N` and transformers' `generate` on the
same GGUF (float32, greedy, the model's chat template), each in its own
process, its peak RSS read from the kernel when it exits (os.wait4).

    python scripts/bench/rss.py [--prompt "What is a KV cache?"] [--max-tokens 16] [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, run as a file


def _peak_rss(cmd: list[str]) -> tuple[int, str]:
    """(peak RSS in bytes, stdout) of `cmd` run to completion."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}")
    return usage.ru_maxrss * 1024, out.strip()  # Linux reports kilobytes


def _hf_generate(prompt: str, max_tokens: int) -> None:
    import torch
    import transformers as tf

    from checkpoints.known_models import fetch_smollm2_gguf

    path = fetch_smollm2_gguf()
    kw = dict(gguf_file=path.name)
    tok = tf.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    model = tf.AutoModelForCausalLM.from_pretrained(
        str(path.parent), dtype=torch.float32, **kw
    ).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = ids if torch.is_tensor(ids) else ids["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    print(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", default="What is a KV cache?")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--hf-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.hf_child:
        _hf_generate(a.prompt, a.max_tokens)
        return 0
    cmds = {
        "jaxkv": [
            sys.executable,
            "-m",
            "jaxkv",
            "generate",
            a.prompt,
            "--max-tokens",
            str(a.max_tokens),
        ],
        "hf": [
            sys.executable,
            os.path.abspath(__file__),
            "--hf-child",
            "--prompt",
            a.prompt,
            "--max-tokens",
            str(a.max_tokens),
        ],
    }
    print("| system | peak RSS (GB), each run | answer |\n|---|---|---|")
    for name, cmd in cmds.items():
        runs = [_peak_rss(cmd) for _ in range(a.runs)]
        print(
            f"| {name} | {', '.join(f'{r / 1e9:.2f}' for r, _ in runs)} | {runs[-1][1][:60]!r} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
