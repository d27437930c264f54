"""Batch files at the edges, on a tiny model: one record per non-blank input
line, in order, whatever the bytes; a job killed mid-run resumes to the same
records as an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jaxkv.core.engine import LLMEngine
from jaxkv.entrypoints.batch import run_batch
from tests.helpers.model_utils import WORDS, make_hf_model, save_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(warmup=False, num_pages=128, page_size=8, max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _, path = make_hf_model(
        "llama", tmp_path_factory.mktemp("tiny-batch"), max_position_embeddings=512
    )
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def eng(tiny):
    return LLMEngine.from_pretrained(str(tiny), **ENGINE)


def run(eng, tmp_path, data: bytes, name="b"):
    inp, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.out.jsonl"
    inp.write_bytes(data)
    counts = run_batch(
        eng, inp, out, defaults={"max_tokens": 3, "temperature": 0.0}, progress=False
    )
    return [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n") if x], counts


def test_odd_lines_each_get_their_own_record(eng, tmp_path):
    lines = [
        b'{"prompt": "what is a cache"}',
        b'{"prompt": "\xff\xfe bad bytes"}',  # not UTF-8
        '{"prompt": "the sea\u2028and the sky", "id": "ls"}'.encode(),  # raw U+2028
        b'{"prompt": "hello", "id": "\\ud800"}',  # an id with a lone surrogate
        b"",
        b'{"prompt": "big top k", "top_k": 3000000000, "temperature": 1.0, "seed": 2}',
        b'{"prompt": "why", "id": "dup"}',
        b'{"prompt": "how", "id": "dup"}',
        b'{"prompt": "\\ud800 lone"}',
        b"not json",
        b'{"prompt": "tail"}',
    ]
    recs, counts = run(eng, tmp_path, b"\n".join(lines) + b"\n")
    assert [r["index"] for r in recs] == list(range(10))
    assert counts == {"written": 10, "errors": 3, "skipped": 0}
    by = {r["index"]: r for r in recs}
    assert "UTF-8" in by[1]["error"] and by[1]["finish_reason"] == "error"
    assert by[2]["id"] == "ls" and by[2]["finish_reason"] == "length"
    assert by[3]["id"] == "\ud800" and by[3]["finish_reason"] == "length"
    assert by[4]["finish_reason"] == "length"  # top_k beyond the vocabulary: off
    assert by[5]["id"] == by[6]["id"] == "dup"
    assert by[7]["error"].startswith("prompt") and "surrogate" in by[7]["error"]
    assert "JSON" in by[8]["error"] and by[9]["finish_reason"] == "length"


def test_a_deeply_nested_line_gets_an_error_record_and_the_job_resumes(eng, tmp_path):
    # ~1500 levels: json.loads raises RecursionError, which once ended the job
    # before any record was written, on every resume too.
    deep = b'{"prompt": "hi", "id": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    lines = [
        b'{"prompt": "what is a cache", "id": "a"}',
        deep,
        b"[" * 100000,
        b'{"prompt": "tail", "id": "z"}',
    ]
    recs, counts = run(eng, tmp_path, b"\n".join(lines) + b"\n")
    assert counts == {"written": 4, "errors": 2, "skipped": 0}
    assert [r["finish_reason"] for r in recs] == ["length", "error", "error", "length"]
    assert "nested too deeply" in recs[1]["error"] and "nested too deeply" in recs[2]["error"]
    assert recs[3]["id"] == "z"
    again, counts = run(eng, tmp_path, b"\n".join(lines) + b"\n")
    assert counts["skipped"] == 4 and again == recs


LINE = st.one_of(
    st.builds(
        lambda w, extra: json.dumps({"prompt": " ".join(w), **extra}),
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=12),
        st.dictionaries(
            st.sampled_from(
                ["max_tokens", "temperature", "top_k", "top_p", "id", "stop", "seed", "bogus"]
            ),
            st.one_of(
                st.integers(-5, 2**40), st.floats(allow_nan=True), st.text(max_size=5), st.none()
            ),
            max_size=3,
        ),
    ),
    st.binary(max_size=40).filter(lambda b: b"\n" not in b),
    st.text(max_size=30)
    .map(lambda t: t.replace("\n", " "))
    .map(lambda t: json.dumps({"prompt": t})),
    st.just('{"prompt": "line\u2028sep\u2029"}'),
    st.just(""),
    st.just("   "),
    st.just(json.dumps({"prompt": "long " * 400})),
)


def test_a_prompt_of_no_tokens_is_named_and_the_rest_are_served(eng, tmp_path):
    # Spaces tokenize to no token with this tokenizer (no BOS): such a request
    # once reached the scheduler, whose allocate raised in the step, so the
    # job ended and every later step failed too (found by the hypothesis test
    # below in CI).
    lines = [
        b'{"prompt": "   "}',
        b'{"prompt": "hello world"}',
        b'{"prompt": " "}',
        b'{"prompt": "the sky"}',
    ]
    recs, counts = run(eng, tmp_path, b"\n".join(lines) + b"\n")
    assert counts == {"written": 4, "errors": 2, "skipped": 0}
    assert [r["finish_reason"] for r in recs] == ["error", "length", "error", "length"]
    assert "prompt:" in recs[0]["error"] and "no token" in recs[0]["error"]
    assert not eng.has_unfinished_requests()


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(lines=st.lists(LINE, min_size=1, max_size=12))
@example(lines=[b"\x1c"])  # str.strip() took this file separator for a blank line: dropped
@example(lines=[b"\x0b", b" \t\r"])
def test_any_batch_file_gets_one_record_per_line(eng, tmp_path, lines):
    data = b"\n".join(
        x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass") for x in lines
    )
    expect = sum(1 for raw in data.split(b"\n") if raw.strip(b" \t\r"))  # JSON's blanks
    recs, counts = run(eng, tmp_path, data, name=f"p{abs(hash(data))}")
    assert [r["index"] for r in recs] == list(range(expect))
    assert counts["written"] == expect
    for r in recs:
        assert r["finish_reason"] in ("stop", "length", "error")
        assert ("error" in r) == (r["finish_reason"] == "error")


def _cli(tiny, inp, out):
    return [
        sys.executable,
        "-m",
        "jaxkv",
        "batch",
        str(inp),
        str(out),
        "--model",
        str(tiny),
        "--quiet",
        "--max-tokens",
        "12",
        "--no-warmup",
        "--num-pages",
        "128",
        "--page-size",
        "8",
        "--max-num-seqs",
        "2",
        "--max-num-batched-tokens",
        "32",
        # one decode step per call: records come out one by one, so the
        # kill lands mid-run even when the machine is fast
        "--num-decode-steps",
        "1",
    ]


def test_killed_job_resumes_to_the_same_records(tiny, tmp_path):
    lines = [
        json.dumps({"prompt": f"{WORDS[i % len(WORDS)]} and {WORDS[(3 * i) % 40]}", "id": f"r{i}"})
        for i in range(24)
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    assert (
        subprocess.run(
            _cli(tiny, inp, whole), env=env, cwd=ROOT, timeout=600, capture_output=True
        ).returncode
        == 0
    )
    proc = subprocess.Popen(
        _cli(tiny, inp, part),
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if part.exists() and part.read_bytes().count(b"\n") >= 4:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    done = part.read_bytes().count(b"\n") if part.exists() else 0
    assert 4 <= done < 24, f"the job was not killed mid-run ({done} records)"
    r = subprocess.run(
        _cli(tiny, inp, part), env=env, cwd=ROOT, timeout=600, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"skipped {done}" in r.stderr
    strip = lambda p: [
        {k: v for k, v in json.loads(x).items() if not k.endswith("_s")}  # noqa: E731
        for x in p.read_text().splitlines()
    ]
    assert strip(part) == strip(whole)
    assert [x["index"] for x in strip(part)] == list(range(24))
