"""`jaxkv serve --enable-lora --lora-modules` and `jaxkv batch` with LoRA
adapters, on a tiny random Llama and random PEFT adapters: every greedy
answer equals Hugging Face transformers + peft's greedy `generate` on the
same prompt ids, for the base model, an adapter given at start and one
loaded at run time; /v1/models lists them; load / unload refusals are
OpenAI-shaped errors naming the problem and the server goes on serving."""

from __future__ import annotations

import copy
import http.client
import json

import openai
import pytest

from jaxkv.entrypoints import cli
from jaxkv.entrypoints.cli_options import parse_lora_module
from jaxkv.entrypoints.openai.server import build_app
from tests.helpers.model_utils import make_hf_model, save_tiny_tokenizer
from tests.helpers.serve_utils import ThreadServer, get, openai_error, post

ENGINE = [
    "--num-pages",
    "48",
    "--page-size",
    "8",
    "--max-num-seqs",
    "4",
    "--max-model-len",
    "64",
    "--no-warmup",
    "--enable-lora",
    "--max-loras",
    "2",
    "--max-lora-rank",
    "8",
]
PROMPT = [1, 9, 14, 22, 7, 30, 11]  # token ids
N = 6  # tokens generated


def _adapter(torch_model, path, r: int, seed: int, scale: float = 3.0):
    import peft
    import torch

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    m = peft.get_peft_model(copy.deepcopy(torch_model), cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    m.save_pretrained(str(path))
    return m


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    import torch

    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("lora")
    torch_model, path = make_hf_model("llama", root / "base")
    save_tiny_tokenizer(path)
    models = {
        "tiny": torch_model,
        "a1": _adapter(torch_model, root / "a1", 4, 1),
        "a2": _adapter(torch_model, root / "a2", 4, 2),
    }
    _adapter(torch_model, root / "big", 16, 3, scale=1.0)  # rank above --max-lora-rank 8
    (root / "empty").mkdir()
    return root, models


def _hf_greedy(model) -> list[int]:
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=N, min_new_tokens=N, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([PROMPT]), generation_config=gen)
    return out[0, len(PROMPT) :].tolist()


@pytest.fixture(scope="module")
def oracle(tiny):
    return {name: _hf_greedy(m) for name, m in tiny[1].items()}


@pytest.fixture(scope="module")
def server(tiny):
    root = tiny[0]
    a = cli.build_parser().parse_args(
        [
            "serve",
            "--model",
            str(root / "base"),
            "--served-model-name",
            "tiny",
            *ENGINE,
            "--lora-modules",
            f"a1={root / 'a1'}",
        ]
    )
    srv = ThreadServer(
        build_app(cli._make_engine(a), a.served_model_name, enable_runtime_lora_loading=True)
    )
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def _served(client, model: str) -> list[int]:
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert r.model == model
    return r.choices[0].token_ids


def _post_text(port: int, path: str, body) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def test_base_and_start_adapter_equal_hf_peft_and_every_endpoint_takes_the_name(client, oracle):
    assert oracle["a1"] != oracle["tiny"] != oracle["a2"]  # the adapters change the answer
    assert _served(client, "tiny") == oracle["tiny"]
    assert _served(client, "a1") == oracle["a1"]
    msgs = [{"role": "user", "content": "what is a cache"}]
    chat = client.chat.completions.create(model="a1", messages=msgs, max_tokens=5, temperature=0)
    base = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0)
    assert chat.model == "a1" and base.model == "tiny"
    assert chat.choices[0].message.content != base.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="a1", messages=msgs, max_tokens=5, temperature=0, stream=True
        )
    )
    assert {c.model for c in chunks} == {"a1"}
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == chat.choices[0].message.content
    )
    resp = client.responses.create(
        model="a1", input="what is a cache", max_output_tokens=5, temperature=0
    )
    assert resp.model == "a1" and resp.output_text == chat.choices[0].message.content
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_models_lists_the_base_and_each_adapter(server, tiny):
    code, body = get(server.port, "/v1/models")
    cards = {m["id"]: m for m in json.loads(body)["data"]}
    assert code == 200 and cards["tiny"]["parent"] is None
    assert cards["a1"]["parent"] == "tiny" and cards["a1"]["root"] == str(tiny[0] / "a1")


def test_load_serve_refuse_and_unload_at_run_time(server, client, tiny, oracle):
    root, port = tiny[0], server.port
    code, text = _post_text(
        port, "/v1/load_lora_adapter", {"lora_name": "a2", "lora_path": str(root / "a2")}
    )
    assert code == 200 and "a2" in text
    assert server.app.state.engine_loop.engine.loras.known["a2"].request.lora_int_id == 2
    assert "a2" in {m.id for m in client.models.list().data}
    assert _served(client, "a2") == oracle["a2"]
    for body, status, words in [
        ({"lora_name": "a2", "lora_path": str(root / "a1")}, 400, "already been loaded"),
        ({"lora_name": "e", "lora_path": str(root / "empty")}, 400, "adapter_config.json"),
        ({"lora_name": "big", "lora_path": str(root / "big")}, 400, "rank"),
        ({"lora_name": "tiny", "lora_path": str(root / "a1")}, 400, "served model"),
        ({"lora_name": "x"}, 400, "lora_path"),
    ]:
        code, err = post(port, "/v1/load_lora_adapter", body)
        assert code == status and words in openai_error(err, status)["message"], (body, err)
    assert {m.id for m in client.models.list().data} == {"tiny", "a1", "a2"}
    assert _served(client, "a1") == oracle["a1"]  # still serving, the adapters unchanged
    code, text = _post_text(port, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert code == 200 and "a2" in text
    with pytest.raises(openai.NotFoundError, match="a2"):
        _served(client, "a2")
    code, err = post(port, "/v1/unload_lora_adapter", {"lora_name": "a2"})
    assert code == 404 and "a2" in openai_error(err, 404)["message"]
    assert _served(client, "tiny") == oracle["tiny"]
    code, metrics = get(port, "/metrics")
    gauges = {
        line.split("{")[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("jaxkv:lora")
    }
    assert gauges["jaxkv:lora_adapters"] == 1 and gauges["jaxkv:lora_slot_loads_total"] >= 2


def test_lora_modules_option_forms_and_refusals(tiny, capsys):
    assert parse_lora_module("a=/x/y") == ("a", "/x/y")
    assert parse_lora_module('{"name": "a", "path": "/x", "base_model_name": "m"}') == ("a", "/x")
    base = ["serve", "--model", str(tiny[0] / "base"), *ENGINE]
    no_lora = [x for x in base if x != "--enable-lora"]
    assert cli.main([*no_lora, "--lora-modules", "a=/x"]) == 2
    assert "--enable-lora" in capsys.readouterr().err
    assert cli.main([*base, "--lora-modules", "a=/x", "a=/y"]) == 2
    assert "more than once" in capsys.readouterr().err
    assert cli.main([*base, "--lora-modules", f"bad={tiny[0] / 'empty'}"]) == 2
    err = capsys.readouterr().err
    assert "bad=" in err and "adapter_config.json" in err


def test_endpoints_answer_404_without_lora(tiny):
    from jaxkv.core.engine import LLMEngine

    eng = LLMEngine.from_pretrained(
        str(tiny[0] / "base"), num_pages=16, page_size=8, max_num_seqs=2, warmup=False
    )
    srv = ThreadServer(build_app(eng, ["tiny"]))
    try:
        code, err = post(
            srv.port, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(tiny[0] / "a1")}
        )
        assert code == 404 and "--enable-lora" in openai_error(err, 404)["message"]
    finally:
        srv.stop()


def test_batch_line_naming_an_adapter_runs_with_it(tiny, oracle, tmp_path):
    root = tiny[0]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"prompt_token_ids": PROMPT, "model": m, "max_tokens": N, "ignore_eos": True}
        for m in ("a1", str(root / "base"), "a2", "nope")
    ]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert (
        cli.main(
            [
                "batch",
                str(inp),
                str(out),
                "--model",
                str(root / "base"),
                "--quiet",
                *ENGINE,
                "--lora-modules",
                f"a1={root / 'a1'}",
                json.dumps({"name": "a2", "path": str(root / "a2")}),
            ]
        )
        == 0
    )
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r.get("token_ids") for r in recs[:3]] == [oracle["a1"], oracle["tiny"], oracle["a2"]]
    assert recs[3]["finish_reason"] == "error" and "'nope'" in recs[3]["error"]
