"""What tenants of one server can see of each other (issue 34): the API key
gates the API and the operator endpoints (/metrics, the page map), the
page map is off unless asked for, and the metrics count every answer of
n > 1 and one running request, checked against the real `openai` client's
usage and raw HTTP."""

from __future__ import annotations

import openai
import pytest

from jaxkv.core.engine import LLMEngine
from jaxkv.entrypoints.openai.server import resolve_api_key
from tests.helpers.model_utils import make_hf_model, save_tiny_tokenizer
from tests.helpers.serve_utils import (
    SSEStream,
    get,
    metric,
    metrics_text,
    openai_error,
    request,
    serving,
    slow_steps,
)

ENGINE = {
    "num_pages": 96,
    "page_size": 8,
    "max_num_seqs": 8,
    "num_decode_steps": 1,
    "warmup": False,
}  # one token a step: a slowed step paces the stream
MODEL = 'model_name="tiny"'
PROMPT = "the cache is"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine for the module; each test's app owns it in turn."""
    _, path = make_hf_model("llama", tmp_path_factory.mktemp("tiny"))
    save_tiny_tokenizer(path)
    return LLMEngine.from_pretrained(str(path), **ENGINE)


def test_api_key_gates_the_api_and_the_operator_endpoints(engine):
    key = "sekret-key"
    with serving(engine, api_key=key, enable_kv_map=True) as srv:
        good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=key, max_retries=0)
        bad = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0)
        r = good.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
        assert r.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        for method, path in [
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("GET", "/v1/kv_map"),
            ("GET", "/metrics"),
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                code, hdrs, body = request(srv.port, method, path, {}, headers)
                assert code == 401 and openai_error(body, 401), (path, headers)
                assert hdrs.get("www-authenticate") == "Bearer"
        auth = {"Authorization": f"Bearer {key}"}
        assert request(srv.port, "GET", "/v1/kv_map", None, auth)[0] == 200
        assert "jaxkv:prompt_tokens_total" in metrics_text(srv.port, auth)
        assert get(srv.port, "/health")[0] == 200  # a load balancer's probe needs no key
        assert get(srv.port, "/")[0] == 200  # static HTML; what it fetches needs the key


def test_api_key_comes_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("JAXKV_API_KEY", "from-env")
    assert resolve_api_key(None) == "from-env" and resolve_api_key("given") == "given"
    monkeypatch.setenv("JAXKV_API_KEY", "")
    assert resolve_api_key(None) is None
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key("")  # `--api-key "$UNSET"` is refused, never "no key"


def test_page_map_is_served_only_when_enabled(engine):
    with serving(engine) as srv:
        for path in ("/", "/v1/kv_map"):
            code, _, body = request(srv.port, "GET", path)
            assert code == 404 and openai_error(body, 404)
        assert get(srv.port, "/metrics")[0] == 200  # without a key, /metrics stays open
    with serving(engine, enable_kv_map=True) as srv:
        assert get(srv.port, "/")[0] == 200
        code, _, m = request(srv.port, "GET", "/v1/kv_map")
        assert code == 200 and m["num_pages"] == engine.bm.num_pages


def test_metrics_count_every_answer_of_n_and_one_running_request(engine):
    with serving(engine) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        names = (
            "generation_tokens_total",
            "prompt_tokens_total",
            "inter_token_latency_seconds_count",
            "time_to_first_token_seconds_count",
        )

        def figures():
            text = metrics_text(srv.port)
            return {n: metric(text, f"jaxkv:{n}{{{MODEL}}}") for n in names}

        before = figures()
        r = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            n=4,
            max_tokens=10,
            seed=3,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        after = figures()
        assert r.usage.completion_tokens == 40
        delta = {n: after[n] - before[n] for n in names}
        assert delta["generation_tokens_total"] == r.usage.completion_tokens
        assert delta["prompt_tokens_total"] == r.usage.prompt_tokens
        assert delta["time_to_first_token_seconds_count"] == 1
        assert delta["inter_token_latency_seconds_count"] == r.usage.completion_tokens - 4
        with slow_steps(engine):
            for prompt in (PROMPT, "one two three four five six seven eight nine ten"):
                s = SSEStream(
                    srv.port,
                    "/v1/completions",
                    {"prompt": prompt, "n": 4, "max_tokens": 200, "ignore_eos": True},
                )
                try:
                    events = s.events()
                    seen = set()
                    for _ in range(200):  # until every answer decodes
                        seen.add(next(events)["choices"][0]["index"])
                        if len(seen) == 4:
                            break
                    text = metrics_text(srv.port)
                finally:
                    s.close()
                assert len(seen) == 4
                assert metric(text, f"jaxkv:num_requests_running{{{MODEL}}}") == 1, prompt
                assert metric(text, f"jaxkv:num_requests_waiting{{{MODEL}}}") == 0, prompt
