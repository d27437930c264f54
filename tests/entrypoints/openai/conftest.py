"""The server the tool-calling and Responses tests share: a random 2-layer
model with SmolLM2's real tokenizer and chat template (llguidance compiles
grammars for it), a reasoning parser on. Module-scoped: each module that
uses it starts its own."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.serve_utils import ThreadServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from jaxkv.core.engine import LLMEngine
    from jaxkv.entrypoints.openai.server import build_app
    from scripts.probe.common import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tools") / "model")
    eng = LLMEngine.from_pretrained(
        str(path), num_pages=64, page_size=16, max_num_seqs=4, warmup=False
    )
    srv = ThreadServer(build_app(eng, ["tiny"], reasoning_parser="qwen3"))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
