"""jaxkv on Ray Serve (`jaxkv.entrypoints.ray_serve`): a local Ray instance
on 127.0.0.1, two engine replicas of a tiny model behind the ingress,
driven by the `openai` client.

- answers equal a lone offline run (`LLM`), greedy and streamed;
- a chat's turns stay on one replica (`PrefixAffinityRouter`), and
  distinct prompts spread over both.
"""

from __future__ import annotations

import openai
import pytest

from jaxkv import LLM, SamplingParams
from tests.helpers.serve_utils import free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

ENGINE = dict(num_pages=64, page_size=16, max_num_seqs=4, warmup=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from scripts.probe.common import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("ray") / "model"))


@pytest.fixture(scope="module")
def url(model):
    from jaxkv.entrypoints.ray_serve import build_app

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app(
            model,
            num_replicas=2,
            engine_options=ENGINE,
            served_model_name="tiny",
            ray_actor_options={"num_cpus": 0.5},
        ),
        route_prefix="/",
    )
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_answers_equal_a_lone_run_through_ray_serve(url, model):
    oracle = LLM(model, **{**ENGINE, "max_num_seqs": 1})
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    for p in ("The cache keeps pages", "Replicas over machines"):
        want = oracle.generate(p, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
        got = c.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
        assert got.choices[0].text == want
        chunks = c.completions.create(
            model="tiny", prompt=p, max_tokens=8, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].text for ch in chunks) == want
    models = c.models.list()
    assert [m.id for m in models.data][0] == "tiny"


def test_a_chat_stays_on_its_replica_and_prompts_spread(url):
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    msgs = [{"role": "system", "content": "Be brief. " * 20}]
    seen = set()
    for t in range(3):
        msgs.append({"role": "user", "content": f"Question {t}?"})
        raw = c.chat.completions.with_raw_response.create(
            model="tiny", messages=msgs, max_tokens=3, temperature=0
        )
        msgs.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
        seen.add(raw.headers["x-jaxkv-replica"])
    assert len(seen) == 1
    spread = {
        c.completions.with_raw_response.create(
            model="tiny", prompt=f"Prompt number {i} about something", max_tokens=1
        ).headers["x-jaxkv-replica"]
        for i in range(16)
    }
    assert len(spread) == 2
