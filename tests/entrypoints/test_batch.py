"""scripts/tools/batch_generate.py end to end (a subprocess, as a user runs it) on a
tiny random model with a chat template: order, error records, resume."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.model_utils import make_hf_model, save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def _lines():
    lines = []
    for i in range(20):
        if i == 6:
            lines.append('{"prompt": "bad sampling value", "top_p": 1.7}')
        elif i == 13:
            lines.append('{"prompt": "unknown field", "temprature": 0.5}')
        elif i % 3 == 0:
            lines.append(
                json.dumps(
                    {
                        "messages": [{"role": "user", "content": f"Say the number {i}."}],
                        "max_tokens": 6,
                        "id": f"q{i}",
                    }
                )
            )
        else:
            lines.append(json.dumps({"prompt": f"{i} plus one is", "max_tokens": 4 + i % 3}))
    return lines


def _run(inp, out, model):
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "tools" / "batch_generate.py"),
            str(inp),
            str(out),
            "--model",
            str(model),
            "--quiet",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "64",
            "--kv-cache-memory",
            "1MB",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )


def test_batch_generate_writes_every_line_in_order_and_resumes(tmp_path):
    _, model = make_hf_model("llama", tmp_path / "tiny", max_position_embeddings=512)
    save_tiny_tokenizer(model)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(_lines()) + "\n")
    r = _run(inp, out, model)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in recs] == list(range(20))
    errors = [x for x in recs if x["finish_reason"] == "error"]
    assert [x["index"] for x in errors] == [6, 13]
    assert "top_p" in errors[0]["error"] and "temprature" in errors[1]["error"]
    for x in recs:
        if x["finish_reason"] != "error":
            assert x["token_ids"] and x["completion_tokens"] == len(x["token_ids"])
            assert x["finish_reason"] in ("stop", "length")
    assert recs[3]["id"] == "q3"
    # Resume: keep the first 9 records plus a torn line, run again.
    kept = out.read_text().splitlines()[:9]
    out.write_text("\n".join(kept) + "\n" + '{"index": 9, "te')
    r = _run(inp, out, model)
    assert r.returncode == 0, r.stderr[-3000:]
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in again] == list(range(20))
    assert "skipped 9" in r.stderr
    # Greedy: the resumed records equal the first run's.
    assert [x.get("token_ids") for x in again] == [x.get("token_ids") for x in recs]
