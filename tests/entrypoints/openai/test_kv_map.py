"""The live KV page (`GET /`, `/v1/kv_map`) while requests run: the JSON
agrees with the block manager, and headless Chromium renders the running
requests' pages in the grid (a DOM dump and a screenshot)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

from jaxkv.core.engine import LLMEngine
from jaxkv.entrypoints.openai import kv_map
from jaxkv.entrypoints.openai.server import build_app
from tests.helpers.model_utils import WORDS, make_hf_model, save_tiny_tokenizer
from tests.helpers.serve_utils import SSEStream, ThreadServer, get

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)"
)
def test_kv_page_draws_the_running_requests(tmp_path):
    _, path = make_hf_model("llama", tmp_path, max_position_embeddings=2048)
    save_tiny_tokenizer(path)
    eng = LLMEngine.from_pretrained(
        str(path), num_pages=256, page_size=8, max_num_seqs=8, warmup=False
    )
    real = eng.runner.dispatch

    def slow(*a, **k):  # keep the requests running while the page is read
        time.sleep(0.15)  # 0.05 let one of 1500 tokens finish under a loaded suite's Chromium
        return real(*a, **k)

    eng.runner.dispatch = slow
    srv = ThreadServer(build_app(eng, ["tiny"], enable_kv_map=True))
    system = " ".join(WORDS[:40])
    bodies = [
        {"prompt": system + " one", "max_tokens": 1500, "ignore_eos": True},
        {"prompt": system + " two", "max_tokens": 1500, "ignore_eos": True},
        {"prompt": "hello world", "max_tokens": 1500, "ignore_eos": True, "n": 2},
    ]
    streams = []
    try:
        for b in bodies:
            s = SSEStream(srv.port, "/v1/completions", {"model": "tiny", **b}, timeout=120)
            next(s.events())
            streams.append(s)
        code, raw = get(srv.port, "/v1/kv_map")
        assert code == 200
        m = json.loads(raw)
        assert len(m["requests"]) == 4 and len(m["pages"]) == eng.bm.num_pages
        assert m["pages"][0] == kv_map.TRASH
        assert m["shared"] >= 5  # the 40-word prefix's full pages, held by two requests
        for k, r in enumerate(m["requests"]):
            assert r["pages"] * m["page_size"] >= r["computed"]
            assert m["pages"].count(k) >= 1
        assert (
            m["free"] + m["cached"] + m["shared"] + 1 + sum(m["pages"].count(k) for k in range(4))
            == m["num_pages"]
        )

        page = _chromium("--virtual-time-budget=5000", "--dump-dom", srv.base_url + "/")
        dom = page.stdout
        assert dom.count('class="req"') >= 4, page.stderr[-2000:]
        assert dom.count('class="shared"') >= 5
        # one legend line per running request (the script's own template aside)
        assert dom.count('<li class="request" data-id="') - dom.count('data-id="${') == 4
        shot = tmp_path / "kv_page.png"
        _chromium(
            "--virtual-time-budget=5000",
            f"--screenshot={shot}",
            "--window-size=1300,900",
            srv.base_url + "/",
        )
        assert shot.is_file() and shot.stat().st_size > 5000
    finally:
        for s in streams:
            s.close()
        srv.stop()
        del eng.runner.dispatch
