"""The `jaxkv` command: options derived from the config dataclasses, and
`jaxkv estimate` against the size formula worked out by hand."""

import dataclasses

import pytest

from jaxkv.config import EngineConfig
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.entrypoints import cli
from tests.helpers.model_utils import make_hf_model, save_tiny_tokenizer


def _sub(parser, name):
    return next(a for a in parser._actions if a.dest == "command").choices[name]


@pytest.mark.parametrize("command", ["generate", "chat", "batch", "serve"])
def test_every_config_field_is_an_option(command):
    p = _sub(cli.build_parser(), command)
    flags = {s for a in p._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineConfig):
        flag = "--engine-seed" if f.name == "seed" else "--" + f.name.replace("_", "-")
        assert flag in flags, flag
    if command == "serve":  # sampling comes with each request
        return
    for f in dataclasses.fields(SamplingParams):
        assert "--" + f.name.replace("_", "-") in flags, f.name


def test_options_reach_the_configs():
    a = cli.build_parser().parse_args(
        [
            "generate",
            "hi",
            "--max-num-seqs",
            "3",
            "--no-enable-prefix-caching",
            "--kv-cache-memory",
            "1GiB",
            "--kv-dtype",
            "int8",
            "--engine-seed",
            "5",
            "--seed",
            "9",
            "--temperature",
            "0.5",
            "--top-k",
            "7",
            "--stop",
            "a",
            "--stop",
            "bc",
            "--stop-token-ids",
            "3",
            "--repetition-penalty",
            "1.1",
            "--logprobs",
            "2",
        ]
    )
    engine = cli.values(a, EngineConfig, prefix=cli.ENGINE)
    cfg = EngineConfig(**engine)
    assert (
        cfg.max_num_seqs,
        cfg.enable_prefix_caching,
        cfg.kv_cache_memory,
        cfg.kv_dtype,
        cfg.seed,
        cfg.warmup,
    ) == (3, False, 2**30, "int8", 5, False)
    sp = cli._params(a)
    assert (
        sp.seed,
        sp.temperature,
        sp.top_k,
        sp.stop,
        sp.stop_token_ids,
        sp.max_tokens,
        sp.repetition_penalty,
        sp.logprobs,
    ) == (9, 0.5, 7, ["a", "bc"], [3], 128, 1.1, 2)
    # Defaults a command does not override are the dataclasses' own.
    b = cli.build_parser().parse_args(["batch", "in", "out"])
    assert EngineConfig(**cli.values(b, EngineConfig, prefix=cli.ENGINE)) == EngineConfig()
    sp = SamplingParams(**cli.values(b, SamplingParams, prefix=cli.SAMPLING))
    assert sp == SamplingParams(max_tokens=128, temperature=0.0)  # the command's two defaults


def test_bad_choice_and_size_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "hi", "--kv-dtype", "int3"])
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "hi", "--kv-cache-memory", "lots"])
    assert "not a size in bytes" in capsys.readouterr().err


def test_estimate_explicit_geometry(capsys):
    assert (
        cli.main(
            [
                "estimate",
                "--layers",
                "48",
                "--kv-heads",
                "64",
                "--head-dim",
                "128",
                "--context",
                "4096",
                "--kv-dtype",
                "float16",
                "--memory",
                "24GB",
                "--weight-bytes",
                "8GB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # 2 x 48 x 64 x 128 x 4096 tokens x 2 bytes
    assert "| total bytes | 6,442,450,944 (6.000 GiB) |" in out
    # 16e9 bytes of KV / (16 tokens x 1,572,864 bytes) = 635 pages, one the
    # trash page; 634 // (4096 / 16) = 2 sequences; 634 x 16 tokens for one.
    assert "- largest batch at context 4,096: 2" in out
    assert "- longest context at batch 1: 10,144 tokens" in out


def test_estimate_of_a_model_folder(tmp_path, capsys):
    _, path = make_hf_model("llama", tmp_path, num_key_value_heads=2)  # 2 layers, 4 heads, D 16
    assert (
        cli.main(
            [
                "estimate",
                "--model",
                str(path),
                "--context",
                "100",
                "--batch",
                "3",
                "--kv-dtype",
                "int8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    # 2 x 2 x 2 x 16 x 100 x 3 x 1 byte, + scales 2 x 2 x 2 x 100 x 3 x 4 bytes
    assert "| data bytes | 38,400 |" in out and "| scale bytes 2·L·KVH·tokens·B·s | 9,600 |" in out
    assert "GQA saves 2x" in out


def test_estimate_shows_the_hybrid_pool_term_by_term(tmp_path, capsys):
    # Gemma 3: 6 layers, five sliding ones of window 8 (pages of 16, chunks
    # of 512 rows: a ring of ceil((8 + 512 - 1) / 16) + 1 = 34 pages).
    _, path = make_hf_model("gemma3", tmp_path, num_hidden_layers=6, num_key_value_heads=2)
    assert cli.main(["estimate", "--model", str(path), "--context", "4096", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    per_token_layer = 2 * 2 * 16 * 2  # K and V, 2 KV heads, D 16, bfloat16
    assert f"| 1 global layers x 4,096 tokens | {per_token_layer * 4096 * 2:,} |" in out
    assert f"| 5 sliding layers x 544 tokens | {5 * per_token_layer * 544 * 2:,} |" in out
    assert "ring of 34 pages" in out


def test_estimate_needs_the_whole_geometry(capsys):
    assert cli.main(["estimate", "--layers", "4"]) == 2
    assert "--kv-heads" in capsys.readouterr().err


def test_generate_and_stream_refuse_a_bad_request_with_exit_2(tmp_path, capsys):
    _, path = make_hf_model("llama", tmp_path)
    save_tiny_tokenizer(path)
    for extra in ([], ["--stream"]):
        rc = cli.main(
            [
                "generate",
                "hello",
                "--raw",
                "--model",
                str(path),
                "--top-p",
                "1.5",
                "--num-pages",
                "32",
                "--page-size",
                "8",
                *extra,
            ]
        )
        assert rc == 2, extra
        assert "top_p" in capsys.readouterr().err


def test_speculative_options(monkeypatch):
    a = cli.build_parser().parse_args(
        [
            "generate",
            "hi",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}',
        ]
    )
    spec = EngineConfig(**cli.values(a, EngineConfig, prefix=cli.ENGINE)).speculative
    assert (
        spec.method,
        spec.num_speculative_tokens,
        spec.prompt_lookup_max,
        spec.prompt_lookup_min,
    ) == ("ngram", 3, 5, 2)
    seen = {}
    monkeypatch.setattr(
        "jaxkv.core.engine.LLMEngine.from_pretrained",
        classmethod(
            lambda cls, model, **kw: seen.update(kw) or (_ for _ in ()).throw(SystemExit(0))
        ),
    )
    a = cli.build_parser().parse_args(["generate", "hi", "--draft-model", "/models/draft"])
    with pytest.raises(SystemExit):
        cli._make_engine(a)
    assert seen["speculative_config"] == {
        "method": "draft_model",
        "model": "/models/draft",
        "num_speculative_tokens": 4,
    }
    a = cli.build_parser().parse_args(
        ["generate", "hi", "--draft-model", "d", "--speculative-config", '{"method": "ngram"}']
    )
    with pytest.raises(ValueError, match="--draft-model"):
        cli._make_engine(a)
    with pytest.raises(SystemExit):  # not JSON: argparse names the option
        cli.build_parser().parse_args(["generate", "hi", "--speculative-config", "{method"])


def test_async_scheduling_option():
    for flags, want in (
        ([], None),
        (["--async-scheduling"], True),
        (["--no-async-scheduling"], False),
    ):
        a = cli.build_parser().parse_args(["generate", "hi", *flags])
        assert (
            EngineConfig(**cli.values(a, EngineConfig, prefix=cli.ENGINE)).async_scheduling is want
        )
