"""Offline and batch parts of the adversarial probe (scripts/probe/__main__.py).

offline: rounds of hostile requests (every SamplingParams field given bad
values, bad prompts and chats) sent in one `LLM.generate` call beside
ordinary controls (greedy, seeded, n = 2..7), then a shared LLM driven from
four threads. A hostile request must finish with an error naming its field;
every control must equal its lone run (an LLM with one seat and no prefix
cache); every prompt gets exactly one output.

batch: a 424-line JSONL file (good lines, bad JSON, unknown fields, bad
values, deep nesting) run by `jaxkv batch` uninterrupted, and again killed
three times part way and resumed: the records must be identical."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from scripts.probe.common import Tally

WORDS = "the cache holds keys and values for every token of the prompt so decode reads them".split()
ENGINE = dict(warmup=False, max_num_seqs=8, num_pages=512, page_size=16, max_num_batched_tokens=256)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _text(i: int, n: int = 12) -> str:
    return " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(n))


def hostile_cases(vocab: int) -> list[tuple[str, object, dict, str]]:
    """(case, prompt, SamplingParams fields, regex the error must match)."""
    bad = {
        "max_tokens": [0, -1, 1.5, "8", None, True, 10.0**30, float("nan")],
        "temperature": [-1, float("nan"), float("inf"), "hot", None],
        "top_k": [-2, 1.5, "a"],
        "top_p": [0, 1.5, -0.1, float("nan")],
        "min_p": [-0.1, 1.5, "x"],
        "presence_penalty": [3, -3, float("nan")],
        "frequency_penalty": [3, float("-inf")],
        "repetition_penalty": [0, -1, "x"],
        "stop": [{}, [""], ["\ud800"], 5, [1]],
        "stop_token_ids": [[-1], [vocab], "a", [1.5], 5],
        "seed": [1.5, "x", True],
        "logprobs": [-1, 21, 1.5, 1000],
        "ignore_eos": ["yes", 1],
        "skip_special_tokens": ["no"],
        "min_tokens": [-1, 1.5],
        "n": [0, -1, 65, 1.5, True, 9],
        "structured_outputs": [
            {"regex": "("},
            {"json": {"type": "nope"}},
            {"choice": []},
            {"choice": ["a"] * 10001},
            {"grammar": "start: ("},
            {"bogus": 1},
            "x",
            {"regex": "a", "choice": ["b"]},
            {"json": "{not json"},
        ],
        "allowed_token_ids": [[], [-1], [vocab], "x", [1.5]],
        "bad_words": [[""], [1], "x", ["\ud800"]],
        "logit_bias": [
            {"²": 1},
            {"٣": 1},
            {"5": 1000},
            {"abc": 1},
            {"5": "x"},
            [1],
            {str(i): 1 for i in range(301)},
            {str(vocab): 1},
        ],
        "prompt_logprobs": [-1, 21, "x"],
    }
    cases = []
    for i, (name, values) in enumerate(bad.items()):
        for j, v in enumerate(values):
            cases.append((f"{name}={v!r}"[:60], _text(i + j), {"max_tokens": 8, name: v}, name))
    cases.append(
        ("min_tokens>max_tokens", _text(1), {"max_tokens": 4, "min_tokens": 8}, "min_tokens")
    )
    long_ids = [(7 * k) % 1000 + 10 for k in range(2100)]
    prompts = [
        ("empty_ids", []),
        ("negative_id", [5, -1]),
        ("id_beyond_vocab", [5, vocab]),
        ("float_id", [5, 1.5]),
        ("string_ids", {"prompt_token_ids": "abc"}),
        ("prompt_int", {"prompt": 5}),
        ("unknown_key", {"wrong": "x"}),
        ("none", None),
        ("surrogate", "hi \ud800 there"),
        ("too_long_ids", long_ids),
        ("too_long_text", " ".join(WORDS * 300)),
        ("bool_ids", [True, False]),
        ("nested_ids", [[1, 2]]),
        ("number", 7),
    ]
    for name, p in prompts:
        cases.append((f"prompt:{name}", p, {"max_tokens": 8}, "prompt|token|max_model_len|length"))
    return cases


def controls(round_: int) -> list[tuple[str, str, dict]]:
    """(case, prompt, SamplingParams fields) of ordinary requests."""
    out = [
        (
            f"greedy{i}",
            _text(100 + 9 * i + round_, 6 + 3 * i),
            {"max_tokens": 12, "temperature": 0.0},
        )
        for i in range(6)
    ]
    out += [
        (
            f"seeded{i}",
            _text(200 + i + round_),
            {"max_tokens": 10, "temperature": 0.8, "seed": 31 * i + round_},
        )
        for i in range(3)
    ]
    out += [
        (f"n{n}", _text(300 + n + round_), {"max_tokens": 8, "temperature": 0.0, "n": n})
        for n in range(2, 8)
    ]
    out.append(
        (
            "n3_seeded",
            _text(400 + round_),
            {"max_tokens": 8, "temperature": 0.9, "seed": 77, "n": 3},
        )
    )
    return out


class _Alarm(Exception):
    pass


def _bounded(seconds: int, fn, *args):
    """fn(*args), raising _Alarm after `seconds` (main thread only)."""

    def ring(*_):
        raise _Alarm(f"no answer in {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_offline(tally: Tally, model: Path, *, rounds: int = 2) -> None:
    """Hostile requests beside controls through LLM.generate; see the module
    docstring. Part "offline"."""
    import re

    from jaxkv.core.requests import child_seed
    from jaxkv.core.sampling_params import SamplingParams
    from jaxkv.entrypoints.llm import LLM

    part = "offline"
    llm = LLM(str(model), **ENGINE)
    lone = LLM(str(model), **{**ENGINE, "max_num_seqs": 1, "enable_prefix_caching": False})
    vocab = llm.engine.model_config.vocab_size
    oracle: dict[tuple, list[int]] = {}

    def lone_ids(prompt: str, fields: dict, index: int) -> list[int]:
        f = {**fields, "n": 1}
        if index and f.get("seed") is not None:
            f["seed"] = child_seed(f["seed"], index)
        key = (prompt, json.dumps(f, sort_keys=True), 0 if f.get("temperature") == 0 else index)
        if key not in oracle:
            oracle[key] = list(
                lone.generate(prompt, SamplingParams(**f), use_tqdm=False)[0].outputs[0].token_ids
            )
        return oracle[key]

    def check_control(case: str, prompt: str, fields: dict, out) -> None:
        n = fields.get("n", 1)
        if out.error or len(out.outputs) != n:
            return tally.add(part, "wrong", case, f"error={out.error!r} answers={len(out.outputs)}")
        for c in out.outputs:
            if list(c.token_ids) != lone_ids(prompt, fields, c.index):
                return tally.add(part, "wrong", case, f"answer {c.index} differs from its lone run")
        tally.add(part, "served", case)

    hostile = hostile_cases(vocab)
    rss0 = None
    for r in range(rounds):
        mix = [("h", c) for c in hostile] + [("c", c) for c in controls(r)]
        mix = (
            mix[r::2] + mix[1 - r :: 2] if r else mix[::-1]
        )  # controls among the hostile, order varied
        prompts, params, built = [], [], []
        for kind, c in mix:
            try:
                sp = SamplingParams(**c[2])
            except Exception as e:  # refused at construction: named if it says which field
                tally.add(part, "named" if re.search(c[3], str(e)) else "unnamed", c[0], repr(e))
                continue
            prompts.append(c[1])
            params.append(sp)
            built.append((kind, c))
        try:
            outs = _bounded(600, lambda: llm.generate(prompts, params, use_tqdm=False))
        except _Alarm as e:
            for _ in built:
                tally.add(part, "hangs", f"round{r}", str(e))
            continue
        except Exception as e:  # the whole call lost
            for _ in built:
                tally.add(part, "crashes", f"round{r}", repr(e))
            continue
        if len(outs) != len(built):
            tally.add(part, "lost", f"round{r}", f"{len(built)} prompts, {len(outs)} outputs")
        for (kind, c), out in zip(built, outs):
            if not out.finished:
                tally.add(part, "lost", c[0], "output not finished")
            elif kind == "c":
                check_control(c[0], c[1], c[2], out)
            elif out.error is None:
                tally.add(part, "wrong", c[0], "a hostile request was served")
            else:
                ok = (
                    re.search(c[3], out.error)
                    and "\n" not in out.error.strip()
                    and len(out.error) < 600
                )
                tally.add(part, "named" if ok else "unnamed", c[0], out.error)
        if rss0 is None:
            rss0 = _rss_mib()
    if rss0 is not None and _rss_mib() - rss0 > 1024:
        tally.add(
            part, "memory", "rounds", f"peak RSS grew {_rss_mib() - rss0:.0f} MiB after round 1"
        )

    # Misuse of the call itself: raised, naming the argument.
    for case, call, match in (
        (
            "params_length",
            lambda: llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False),
            "sampling",
        ),
        ("chat_no_content", lambda: llm.chat([{"role": "user"}]), "messages"),
        ("chat_empty", lambda: llm.chat([]), "messages"),
        ("chat_not_list", lambda: llm.chat(5), "messages|conversation"),
    ):
        try:
            res = call()
            err = getattr(res[0], "error", None) if res else None
            tally.add(
                part,
                "named" if err and re.search(match, err) else "wrong",
                case,
                f"answered: {err!r}",
            )
        except (ValueError, TypeError) as e:
            tally.add(part, "named" if re.search(match, str(e), re.I) else "unnamed", case, repr(e))
        except Exception as e:
            tally.add(part, "crashes", case, repr(e))

    # One LLM shared by four threads: each thread's answers equal lone runs.
    results: dict[int, object] = {}

    def worker(t: int) -> None:
        try:
            ps = [_text(500 + 3 * t + k) for k in range(3)]
            results[t] = (
                ps,
                llm.generate(ps, SamplingParams(max_tokens=10, temperature=0.0), use_tqdm=False),
            )
        except Exception as e:
            results[t] = e

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    for t in range(4):
        got = results.get(t)
        if got is None:
            tally.add(part, "hangs", f"thread{t}", "no answer in 300 s")
        elif isinstance(got, Exception):
            tally.add(part, "crashes", f"thread{t}", repr(got))
        else:
            for p, out in zip(*got):
                check_control(f"thread{t}", p, {"max_tokens": 10, "temperature": 0.0}, out)


# --------------------------------------------------------------------- batch
def batch_lines(count: int = 424) -> list[str]:
    """`count` JSONL lines: mostly good ones, one bad line in ten."""
    bad = [
        '{"prompt": "unclosed',
        "[1, 2, 3]",
        '"just a string"',
        '{"prompt": "x", "bogus_field": 1}',
        '{"prompt": "x", "max_tokens": -3}',
        '{"prompt": "x", "temperature": "hot"}',
        '{"messages": "not a list"}',
        '{"id": ' + "[" * 1500 + "]" * 1500 + ', "prompt": "x"}',
        "[" * 100000 + "]" * 100000,
        '{"prompt": "x", "n": 100}',
        '{"prompt": 5}',
        '{"prompt": "x", "logit_bias": {"²": 1}}',
        '{"prompt": "x", "structured_outputs": {"regex": "("}}',
    ]
    lines = []
    for i in range(count):
        if i % 10 == 7:
            lines.append(bad[(i // 10) % len(bad)])
        elif i % 10 == 3:
            lines.append(
                json.dumps(
                    {
                        "id": f"chat-{i}",
                        "messages": [{"role": "user", "content": _text(i, 6)}],
                        "max_tokens": 6,
                    }
                )
            )
        else:
            lines.append(
                json.dumps(
                    {
                        "id": i,
                        "prompt": _text(i, 4 + i % 9),
                        "max_tokens": 6 + i % 3,
                        **({"n": 2} if i % 10 == 5 else {}),
                    }
                )
            )
    return lines


KEEP = ("index", "id", "text", "token_ids", "finish_reason", "error", "outputs")


def _records(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        keep = {k: rec.get(k) for k in KEEP}
        if isinstance(keep["outputs"], list):
            keep["outputs"] = [
                {k: o.get(k) for k in ("index", "text", "token_ids", "finish_reason")}
                for o in keep["outputs"]
            ]
        out.append(keep)
    return out


def run_batch(tally: Tally, root: Path, model: Path, *, kills: int = 3) -> None:
    """`jaxkv batch` uninterrupted, then killed `kills` times and resumed.
    Part "batch": each record of the resumed run equal to the uninterrupted
    one (served / named for good / bad lines), a missing record lost."""
    part = "batch"
    root.mkdir(parents=True, exist_ok=True)
    src = root / "in.jsonl"
    lines = batch_lines()
    src.write_text("\n".join(lines) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "jaxkv",
        "batch",
        "--quiet",
        "--model",
        str(model),
        "--temperature",
        "0",
        "--no-warmup",
        "--max-num-seqs",
        "16",
        "--num-pages",
        "512",
        "--page-size",
        "16",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    whole = root / "whole.jsonl"
    p = subprocess.run(
        cmd + [str(src), str(whole)], capture_output=True, text=True, timeout=900, env=env
    )
    if p.returncode != 0:
        return tally.add(part, "crashes", "uninterrupted", p.stderr[-300:])
    resumed = root / "resumed.jsonl"
    for k in range(kills):
        before = resumed.read_bytes().count(b"\n") if resumed.exists() else 0
        child = subprocess.Popen(
            cmd + [str(src), str(resumed)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        t0 = time.monotonic()
        while time.monotonic() - t0 < 300 and child.poll() is None:
            now = resumed.read_bytes().count(b"\n") if resumed.exists() else 0
            if now >= before + 40 + 20 * k:
                break
            time.sleep(0.05)
        if child.poll() is not None:  # finished before the kill: the resume went untested
            return tally.add(part, "wrong", f"kill{k}", "the job ended before it could be killed")
        child.kill()
        child.wait()
        done = resumed.read_bytes().count(b"\n") if resumed.exists() else 0
        print(f"batch: killed at {done} of {len(lines)} records", file=sys.stderr, flush=True)
    p = subprocess.run(
        cmd + [str(src), str(resumed)], capture_output=True, text=True, timeout=900, env=env
    )
    if p.returncode != 0:
        return tally.add(part, "crashes", "final resume", p.stderr[-300:])
    want, got = _records(whole), _records(resumed)
    if len(want) != len(lines):
        tally.add(part, "lost", "uninterrupted", f"{len(lines)} lines, {len(want)} records")
    for i, _line in enumerate(lines):
        if i >= len(got):
            tally.add(part, "lost", f"line{i}", "no record after the resumes")
        elif i < len(want) and got[i] != want[i]:
            tally.add(
                part, "wrong", f"line{i}", f"resumed {str(got[i])[:120]} != {str(want[i])[:120]}"
            )
        elif got[i]["error"]:
            tally.add(part, "named" if i % 10 == 7 else "wrong", f"line{i}", got[i]["error"])
        else:
            tally.add(
                part, "served" if i % 10 != 7 else "wrong", f"line{i}", "a bad line was served"
            )
    if len(got) > len(lines):
        tally.add(part, "wrong", "extra", f"{len(got) - len(lines)} records too many")
