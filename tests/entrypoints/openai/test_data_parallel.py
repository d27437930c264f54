"""`jaxkv serve --data-parallel-size 2`, run as users run it (the CLI, two
replica processes on a core each), with the `openai` client:

- answers equal a lone offline run (`LLM`, one request at a time), greedy
  and seeded, whichever replica answers;
- a conversation's later turns go to the replica that cached its earlier
  ones (the replicas' KV events), and distinct prompts in flight together
  spread over both;
- `/metrics` labels each replica's series `engine="i"`, `/get_load` has a
  row per rank, `X-data-parallel-rank` picks the replica;
- a replica killed mid-stream: that stream ends with an error naming it,
  the other replica goes on serving, and the killed one comes back.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import openai
import pytest

from jaxkv import LLM, SamplingParams
from tests.helpers.serve_utils import SSEStream, get, request, start_cli_server

ENGINE = ["--num-pages", "96", "--page-size", "16", "--max-num-seqs", "4", "--no-warmup"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from scripts.probe.common import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("dp") / "model")


@pytest.fixture(scope="module")
def front(model):
    proc, port = start_cli_server(model, "--data-parallel-size", "2", *ENGINE)
    proc.port = port
    yield proc
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except Exception:  # noqa: BLE001
        proc.kill()


@pytest.fixture(scope="module")
def oracle(model):
    return LLM(str(model), num_pages=96, page_size=16, max_num_seqs=1, warmup=False)


def client(port):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
    )


def info(port) -> dict:
    return json.loads(get(port, "/get_server_info")[1])


def test_answers_equal_a_lone_offline_run(front, oracle, model):
    c = client(front.port)
    prompts = ["The cache keeps pages of", "Once upon a time", "A router sends each request"]
    for p in prompts:
        want = oracle.generate(p, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
        for _ in range(2):  # the second finds its pages cached
            got = c.completions.create(model=str(model), prompt=p, max_tokens=8, temperature=0)
            assert got.choices[0].text == want.text
    kw = dict(max_tokens=8, temperature=0.9, seed=11)
    want = oracle.generate(prompts[0], SamplingParams(**kw))[0].outputs[0].text
    for rank in ("0", "1"):
        got = c.with_options(default_headers={"X-data-parallel-rank": rank}).completions.create(
            model=str(model), prompt=prompts[0], **kw
        )
        assert got.choices[0].text == want, rank


def test_turns_follow_their_pages_and_distinct_prompts_spread(front, model):
    c = client(front.port)
    ranks = []
    for k in range(2):
        msgs = [{"role": "system", "content": f"Assistant {k}. " + "Be brief and kind. " * 12}]
        for t in range(3):
            msgs.append({"role": "user", "content": f"Question {t}?"})
            raw = c.chat.completions.with_raw_response.create(
                model=str(model), messages=msgs, max_tokens=4, temperature=0
            )
            out = raw.parse()
            msgs.append({"role": "assistant", "content": out.choices[0].message.content})
            ranks.append((k, t, raw.headers["x-data-parallel-rank"]))
            if t:
                assert out.usage.prompt_tokens_details.cached_tokens > 0, ranks
    for k in range(2):  # each chat stays where its system prompt is cached
        assert len({r for kk, _, r in ranks if kk == k}) == 1, ranks

    # four distinct long streams at once: the least loaded replica takes each new one
    def stream(i):
        raw = c.completions.with_raw_response.create(
            model=str(model),
            prompt=f"Story {i}: " + "words " * 40,
            max_tokens=64,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return raw.headers["x-data-parallel-rank"]

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        assert set(ex.map(stream, range(4))) == {"0", "1"}


def test_metrics_load_and_the_rank_header(front, model):
    text = get(front.port, "/metrics")[1]
    for rank in ("0", "1"):
        assert f'jaxkv:prompt_tokens_total{{model_name="{model}",engine="{rank}"}}' in text
    assert text.count("# TYPE jaxkv:prompt_tokens_total counter") == 1
    load = json.loads(get(front.port, "/get_load")[1])
    assert [x["dp_rank"] for x in load] == [0, 1]
    i = info(front.port)
    assert i["dp_size"] == 2 and [r["healthy"] for r in i["replicas"]] == [True, True]
    body = {"model": str(model), "prompt": "Hi", "max_tokens": 1}
    st, h, _ = request(front.port, "POST", "/v1/completions", body, {"X-data-parallel-rank": "1"})
    assert st == 200 and h["x-data-parallel-rank"] == "1"
    st, _, err = request(front.port, "POST", "/v1/completions", body, {"X-data-parallel-rank": "2"})
    assert st == 400 and "X-data-parallel-rank" in err["error"]["message"]
    st, _, err = request(front.port, "POST", "/v1/completions", {"model": str(model)})
    assert st == 400 and "prompt" in err["error"]["message"]


def test_a_killed_replica_fails_its_stream_by_name_and_comes_back(front, model):
    body = {"model": str(model), "prompt": "Go on", "max_tokens": 900, "ignore_eos": True}
    s = SSEStream(front.port, "/v1/completions", body)
    # kill the replica that answers
    rank = int(s.resp.getheader("x-data-parallel-rank"))
    pid = info(front.port)["replicas"][rank]["pid"]
    events = s.events()
    assert "choices" in next(events)
    os.kill(pid, signal.SIGKILL)
    rest = list(events)
    s.close()
    errors = [e for e in rest if isinstance(e, dict) and "error" in e]
    assert errors and f"replica {rank}" in errors[0]["error"]["message"], rest[-3:]
    c = client(front.port)
    for i in range(3):  # the other replica serves meanwhile
        assert c.completions.create(model=str(model), prompt=f"Hi {i}", max_tokens=2).choices
    deadline = time.monotonic() + 50
    while time.monotonic() < deadline:
        r = info(front.port)["replicas"][rank]
        if r["healthy"] and r["restarts"] == 1 and r["pid"] != pid:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"replica {rank} did not come back: {r}")
