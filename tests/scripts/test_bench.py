"""The benchmark harness on a tiny random model (jaxkv and transformers on
the same Hugging Face folder): every figure is derived from the measured
times, warm-up leaves nothing to compile in timed runs, goals follow the
numbers. No timing goals are asserted here."""

import dataclasses
import json

import pytest

from scripts.bench import generation as bench
from scripts.bench import plot as bench_plot
from tests.helpers.model_utils import make_hf_model

# One xdist worker runs this module: its benchmark fixture runs once.
pytestmark = pytest.mark.xdist_group("bench")

TINY = bench.Sizes(
    decode_batches=(1, 4),
    hf_decode_batches=(1, 4),
    decode_prompt=12,
    decode_steps=3,
    prefill_lens=(40,),
    prefill_chunked=(600,),
    e2e_requests=5,
    e2e_prompt=(3, 30),
    e2e_output=(2, 6),
    sequential_runs=2,
    bandwidth_bytes=8 << 20,
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    _, path = make_hf_model("llama", tmp_path_factory.mktemp("tiny"), max_position_embeddings=1024)
    # 8 sequences and 256-token steps at most: fewer programs to compile
    return bench.run_benchmarks(
        str(path),
        peer="hf",
        sizes=TINY,
        runs=2,
        also_quantize=("w8a8",),
        engine_options=dict(max_num_seqs=8, max_num_batched_tokens=256),
        log=lambda m: None,
    )


def _check_entry(s, runs=2):
    assert len(s["runs_seconds"]) == len(s["runs_tokens"]) == runs
    assert s["runs_tok_per_s"] == pytest.approx(
        [n / t for n, t in zip(s["runs_tokens"], s["runs_seconds"])]
    )
    assert s["tok_per_s"] == pytest.approx(sum(s["runs_tok_per_s"]) / runs)  # median of 2


def test_figures_come_from_the_measured_runs(results):
    for key, B in (("batch1", 1), ("batch4", 4)):
        e = results["decode"][key]
        for system in ("jaxkv", "hf"):
            _check_entry(e[system])
        assert e["hf"]["runs_tokens"] == [B * TINY.decode_steps] * 2
        # The engine decodes at least N tokens per sequence in the window.
        assert min(e["jaxkv"]["runs_tokens"]) >= B * TINY.decode_steps
        assert e["ratio"] == pytest.approx(e["jaxkv"]["tok_per_s"] / e["hf"]["tok_per_s"])
        j = e["jaxkv"]
        assert j["bandwidth_fraction"] == pytest.approx(
            j["bytes_per_s"] / results["bandwidth"]["read_bytes_per_s"]
        )
        # weights + K/V of B sequences holding at least the prompt
        assert j["bytes_per_step"] > (
            results["model"]["weight_bytes"]
            + B * TINY.decode_prompt * results["model"]["kv_bytes_per_token"]
        )
    for key, B in (("batch1", 1), ("batch4", 4)):  # the w8a8 engine beside the others
        e = results["decode"][key]
        v = e["variants"]["w8a8"]
        _check_entry(v)
        assert min(v["runs_tokens"]) >= B * TINY.decode_steps
        assert v["ratio_vs_jaxkv"] == pytest.approx(v["tok_per_s"] / e["jaxkv"]["tok_per_s"])
        assert v["ratio"] == pytest.approx(v["tok_per_s"] / e["hf"]["tok_per_s"])
    p = results["prefill"]["tokens40"]
    _check_entry(p["jaxkv"])
    assert p["jaxkv"]["runs_tokens"] == [40, 40]
    assert p["steps"] == 1 and p["token_budget"] >= 40
    assert p["ratio"] == pytest.approx(p["jaxkv"]["tok_per_s"] / p["hf"]["tok_per_s"])
    c = results["prefill"]["tokens600_chunked"]  # 256-token chunks (engine_options)
    _check_entry(c["jaxkv"])
    assert c["jaxkv"]["runs_tokens"] == [600, 600] and (c["steps"], c["token_budget"]) == (3, 256)
    assert c["ratio"] == pytest.approx(c["jaxkv"]["tok_per_s"] / c["hf"]["tok_per_s"])
    t = results["ttft"]["prompt40"]
    assert t["ratio"] == pytest.approx(t["hf"]["ms"] / t["jaxkv"]["ms"])

    e2e = results["e2e"]
    assert e2e["num_requests"] == 5
    b, s = e2e["batched"]["jaxkv"], e2e["sequential"]["jaxkv"]
    _check_entry(b)
    assert b["output_tokens"] == s["output_tokens"] == sum(e2e["output_lens"])
    assert b["prompt_tokens"] == sum(e2e["prompt_lens"])
    assert e2e["ratio_batched_over_sequential"] == pytest.approx(b["tok_per_s"] / s["tok_per_s"])
    h = e2e["batched"]["hf"]  # HF's one padded generate of the same requests
    assert h["tokens"] == sum(e2e["output_lens"])
    assert h["generated_tokens"] == 5 * max(e2e["output_lens"])
    assert e2e["batched"]["ratio"] == pytest.approx(b["tok_per_s"] / h["tok_per_s"])
    assert 0 <= b["host_overhead_s"] < max(b["runs_seconds"])
    assert (
        b["ttft_ms_median"] <= b["ttft_ms_p90"] <= b["ttft_ms_max"] <= 1e3 * max(b["runs_seconds"])
    )


def test_warm_up_compiles_everything_the_timed_runs_need(results):
    late = [
        e["jaxkv"]["new_compiles_in_timed_runs"]
        for ph in ("decode", "prefill")
        for e in results[ph].values()
    ]
    late += [
        results["e2e"][m]["jaxkv"]["new_compiles_in_timed_runs"] for m in ("batched", "sequential")
    ]
    assert late == [0] * len(late)
    c = results["compile"]
    # Every program was compiled (or served by the persistent cache) once, at warm-up.
    assert c["programs"] >= 4 and c["xla_compiles"] + c["cache_hits"] >= c["programs"]
    assert sum(w["new_programs"] for w in c["warm_up"].values()) == c["programs"]


def test_report_and_json(results, tmp_path):
    text = bench.format_report(results)
    assert "| jaxkv      | decode" in text and "| hf         | decode" in text
    assert "| jaxkv w8a8 | decode" in text and "prefill 600 in 3 chunks of 256" in text
    assert "e2e batched" in text and "WARNING" not in text
    out = tmp_path / "r.json"
    out.write_text(json.dumps(results, default=float))
    back = json.loads(out.read_text())
    assert back["decode"]["batch4"]["hf"]["tok_per_s"] > 0
    assert {"jax", "cpu", "date", "hf_torch"} <= back["meta"].keys()


def test_plot_draws_every_figure(results, tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    figs = bench_plot.figures(results)
    labels = [label for label, _ in figs]
    assert labels == [
        "decode\nbatch 1",
        "decode\nbatch 4",
        "prefill 40",
        "prefill 600\n3 x 256",
        "e2e 5\nrequests",
    ]
    assert figs[0][1] == {
        "jaxkv": results["decode"]["batch1"]["jaxkv"]["tok_per_s"],
        "jaxkv w8a8": results["decode"]["batch1"]["variants"]["w8a8"]["tok_per_s"],
        "hf": results["decode"]["batch1"]["hf"]["tok_per_s"],
    }
    path = bench_plot.write_plot(results, tmp_path / "r.png")
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= 800


def test_goals_follow_the_numbers(results):
    res = json.loads(json.dumps(results, default=float))
    res["decode"]["batch1"]["ratio"] = 2.5
    res["decode"]["batch16"] = dict(res["decode"]["batch4"], ratio=2.9)
    limit = res["bandwidth"]["read_bytes_per_s"] / res["model"]["weight_bytes"]
    res["decode"]["batch1"]["jaxkv"]["tok_per_s"] = 0.9 * limit
    res["e2e"]["num_requests"] = 64
    res["e2e"]["batched"]["jaxkv"]["tok_per_s"] = 299.0
    res["prefill"] = dict(
        tokens256=dict(res["prefill"]["tokens40"], prompt_tokens=256, ratio=1.3),
        tokens4096_chunked=dict(
            res["prefill"]["tokens600_chunked"],
            prompt_tokens=4096,
            steps=8,
            token_budget=512,
            ratio=0.9,
        ),
    )
    res["prefill"]["tokens256"]["jaxkv"] = dict(
        res["prefill"]["tokens256"]["jaxkv"], tok_per_s=330.0
    )
    got = {g["name"]: (g["met"], round(g["value"], 6)) for g in bench.evaluate_goals(res)}
    assert got == {
        "decode batch 1 vs HF": (True, 2.5),
        "decode batch 1 vs fp32 bandwidth limit": (True, 0.9),
        "decode batch 16 vs HF": (False, 2.9),
        "e2e 64 mixed requests, output tok/s": (False, 299.0),
        "prefill 256 vs llama.cpp": (True, round(330 / 160, 6)),
        "prefill 256 vs HF": (True, 1.3),
        "prefill 4096 in 8 chunks of 512 vs HF": (False, 0.9),
    }
    res["decode"]["batch1"]["jaxkv"]["tok_per_s"] = 0.8 * limit
    g = [g for g in bench.evaluate_goals(res) if "bandwidth" in g["name"]][0]
    assert not g["met"]
    assert "MISSED (80%)" in bench.format_report(dict(res, goals=bench.evaluate_goals(res)))


def test_cli_rejects_bad_runs():
    with pytest.raises(SystemExit):
        bench.main(["--runs", "0"])


def test_prompts_are_fixed_and_sized():
    stream = bench.prompt_stream(None, 100, 50)
    assert stream == bench.prompt_stream(None, 100, 50) and len(stream) == 50
    ps = bench.make_prompts(stream, [5, 50, 7])
    assert [len(p) for p in ps] == [5, 50, 7] and ps[0] != ps[2][:5]
    assert bench.e2e_lengths(bench.FULL) == bench.e2e_lengths(dataclasses.replace(bench.FULL))
