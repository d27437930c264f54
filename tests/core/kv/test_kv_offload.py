"""KV beyond the device pool (`jaxkv.core.kv.tiers`, `jaxkv.core.kv.disk`):
greedy tokens with the host tier, swap-style preemption and the disk tier
against lone uncached runs of each prompt (synchronous and overlapped
steps); a restarted engine served from the disk tier; corrupt, truncated
and foreign page files skipped; a FIFO, a link to /dev/zero, a huge file
and a forged page in the disk tier's folder skipped, logged and removed;
two engines on one folder within one budget; tenants' salts kept apart on
every tier; each tier within its bound; what the tier does not serve
refused by name."""

import dataclasses
import logging

import numpy as np
import pytest

from jaxkv.config import EngineConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.kv.disk import SUFFIX
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama
from tests.helpers.sharding_worker import ENGINE, FAMILY, TINY, prompts

MODEL = dataclasses.replace(TINY, num_layers=1)
PAGE_BYTES = 2 * 2 * 8 * 64 * 4  # k and v x 2 KV heads x 8 tokens x 64 x float32


@pytest.fixture(scope="module")
def model():
    return Llama.random_init(MODEL, seed=1)


@pytest.fixture(scope="module")
def lone(model):
    """Greedy tokens of each prompt run alone in a roomy uncached engine (the oracle)."""
    memo = {}

    def tokens(p, max_tokens=6):
        key = (tuple(p), max_tokens)
        if key not in memo:
            eng = LLMEngine(
                model,
                None,
                EngineConfig(
                    **{**ENGINE, "num_pages": 64, "max_num_seqs": 1, "enable_prefix_caching": False}
                ),
            )
            rid = eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0))
            memo[key] = eng.run_to_completion([rid])[rid].outputs[0].token_ids
            eng.shutdown()
        return memo[key]

    return tokens


def _engine(model, **kw):
    return LLMEngine(model, None, EngineConfig(**{**ENGINE, **kw}))


def _run(eng, ps, salt=None, max_tokens=6):
    ids = [
        eng.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0), cache_salt=salt)
        for p in ps
    ]
    out = eng.run_to_completion(ids)
    return [out[i].outputs[0].token_ids for i in ids]


def _hits(eng):
    return eng.tier.stats.host_hit_pages + eng.tier.stats.disk_hit_pages


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_host_tier_gives_the_tokens_of_lone_uncached_runs(model, lone, overlap):
    """Two rounds of prompts through a pool that preempts: pages leave for
    the host and come back, and every output is a lone run's."""
    ps = prompts(MODEL.vocab_size, 10)
    eng = _engine(model, kv_offload_memory="2MB", async_scheduling=overlap)
    got = _run(eng, ps) + _run(eng, ps)
    st = eng.tier.stats
    assert eng.scheduler.num_preemptions > 0
    assert st.pages_out > 0 and st.pages_in > 0 and st.host_hit_pages > 0, st
    assert st.bytes_in == st.pages_in * PAGE_BYTES
    if overlap:
        assert eng.stats["overlapped_steps"] > 0
    assert got == [lone(p) for p in ps + ps]
    eng.shutdown()


def test_a_preempted_sequence_resumes_from_the_host_tier(model, lone):
    """Unrelated prompts (no shared prefixes) whose answers outgrow a small
    pool: the preempted sequences' pages are taken by the others, and with
    the tier they come back from the host instead of being computed again."""
    rng = np.random.default_rng(5)
    ps = [[int(t) for t in rng.integers(1, MODEL.vocab_size, int(n))] for n in (40, 33, 47, 38)]
    computed = {}
    for kw in ({}, {"kv_offload_memory": "2MB"}):
        eng = _engine(model, num_pages=12, **kw)
        assert _run(eng, ps, max_tokens=32) == [lone(p, 32) for p in ps]
        assert eng.scheduler.num_preemptions > 0
        computed[bool(kw)] = eng.stats["prompt_tokens_computed"]
        if kw:
            assert eng.tier.stats.host_hit_pages > 0
        eng.shutdown()
    # Measured: 173 tokens computed without the tier, 158 (the prompts) with it.
    assert computed[True] < computed[False], computed


def test_a_restarted_engine_is_served_from_the_disk_tier(model, lone, tmp_path, caplog):
    """A host tier of 3 pages spills to disk; a new engine on the same
    directory finds the first repeated prompt there; corrupt, truncated and
    foreign files are skipped with a log line; the disk stays in bounds."""
    ps = prompts(MODEL.vocab_size, 10)
    kw = dict(
        kv_offload_memory=3 * PAGE_BYTES,
        kv_offload_dir=str(tmp_path),
        kv_offload_disk=40 * PAGE_BYTES,
    )
    eng = _engine(model, **kw)
    assert _run(eng, ps) == [lone(p) for p in ps]
    disk = eng.tier.disk
    assert eng.tier.stats.disk_writes > 0 and 0 < len(disk) <= 40 * PAGE_BYTES // disk.file_bytes
    assert eng.tier.nbytes <= 3 * PAGE_BYTES
    eng.shutdown()
    files = sorted(disk.dir.glob("*" + SUFFIX))
    assert sum(f.stat().st_size for f in files) <= 40 * PAGE_BYTES

    eng = _engine(model, **kw)
    assert _run(eng, ps[1:2]) == [lone(ps[1])]  # a prompt with a shared prefix
    assert eng.tier.stats.disk_hit_pages > 0 and eng.tier.stats.disk_skipped == 0
    eng.shutdown()

    files = sorted(disk.dir.glob("*" + SUFFIX))
    for i, f in enumerate(files):  # every file damaged one of three ways
        raw = bytearray(f.read_bytes())
        if i % 3 == 0:
            raw[len(raw) // 2] ^= 0xFF  # corrupt
        elif i % 3 == 1:
            raw = raw[:-100]  # truncated
        else:
            raw[8] ^= 1  # another fingerprint in the header: foreign
        f.write_bytes(bytes(raw))
    eng = _engine(model, **kw)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        assert _run(eng, ps) == [lone(p) for p in ps]
    st = eng.tier.stats
    assert st.disk_hit_pages == 0 and st.disk_skipped >= 3, st
    msgs = " ".join(r.getMessage() for r in caplog.records)
    for why in ("MAC does not match", "bytes, a page file has", "another model or layout"):
        assert why in msgs
    eng.shutdown()


def test_tenants_never_hit_each_others_pages_on_any_tier(model, lone, tmp_path):
    ps = prompts(MODEL.vocab_size, 10)
    eng = _engine(model, kv_offload_memory=3 * PAGE_BYTES, kv_offload_dir=str(tmp_path))
    _run(eng, ps, salt="tenant-a")
    before = _hits(eng)
    assert _run(eng, ps[:4], salt="tenant-b") == [lone(p) for p in ps[:4]]
    assert _hits(eng) == before  # b's chain of hashes is its own
    _run(eng, ps[:4], salt="tenant-a")
    assert _hits(eng) > before
    eng.shutdown()


def test_what_the_tier_does_not_serve_is_refused_by_name(model, tmp_path):
    with pytest.raises(ValueError, match="set kv_offload_memory too"):
        EngineConfig(kv_offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineConfig(kv_offload_memory="1GB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_memory holds no page"):
        _engine(model, kv_offload_memory=1)
    with pytest.raises(ValueError, match="hybrid KV pool"):
        _engine(Llama.random_init(FAMILY, seed=0), kv_offload_memory="1MB")
    with pytest.raises(ValueError, match="draft model"):
        LLMEngine(
            model,
            None,
            EngineConfig(
                **ENGINE,
                kv_offload_memory="1MB",
                speculative_config={
                    "method": "draft_model",
                    "model": "given",
                    "num_speculative_tokens": 2,
                },
            ),
            draft_model=model,
        )


def test_metrics_and_the_kv_page_show_the_tiers(model, tmp_path):
    """/metrics counts what the tiers served and moved, in tokens and bytes
    of the hand-computed page size; the live KV page draws the host tier."""
    from jaxkv.entrypoints.openai import kv_map
    from jaxkv.entrypoints.openai.metrics import ServerMetrics

    ps = prompts(MODEL.vocab_size, 10)
    eng = _engine(model, kv_offload_memory=6 * PAGE_BYTES, kv_offload_dir=str(tmp_path))
    metrics = ServerMetrics("tiny")
    _run(eng, ps)
    metrics.refresh(eng)
    _run(eng, ps)
    metrics.refresh(eng)
    kv = eng.kv_metrics()
    st = eng.tier.stats
    assert kv["host_hit_tokens"] == 8 * st.host_hit_pages > 0
    assert kv["bytes_out"] == PAGE_BYTES * st.pages_out > 0
    assert kv["host_bytes"] <= kv["host_max_bytes"] == 6 * PAGE_BYTES
    text = metrics.render().decode()

    def value(series):
        line = next(x for x in text.splitlines() if x.startswith(series + " "))
        return float(line.split()[-1])

    assert (
        value('jaxkv:kv_offload_hit_tokens_total{model_name="tiny",tier="host"}')
        == kv["host_hit_tokens"]
    )
    assert (
        value('jaxkv:kv_offload_bytes_total{direction="in",model_name="tiny"}')
        == PAGE_BYTES * st.pages_in
    )
    assert value('jaxkv:kv_offload_tier_bytes{model_name="tiny",tier="host"}') == kv["host_bytes"]
    assert value('jaxkv:kv_offload_copy_seconds_total{model_name="tiny"}') > 0
    m = kv_map.snapshot(eng)
    host = m["tiers"]["host"]
    assert len(host["pages"]) == len(eng.tier) <= host["capacity"] == 6
    assert set(host["pages"]) <= {1, 2, 3} and m["tiers"]["disk"]["pages"] == len(eng.tier.disk)
    assert "host_grid" in kv_map.PAGE
    eng.shutdown()


def test_a_restarted_server_serves_its_first_repeated_prompt_from_disk(model, lone, tmp_path):
    """A server's stop writes its prefix cache to the disk tier; a new
    server on the same directory answers the same prompt with the same
    tokens, its prompt pages counted on /metrics as disk hits."""
    from tests.helpers.serve_utils import get, metric, post, serving

    prompt = prompts(MODEL.vocab_size, 2)[1]
    kw = dict(kv_offload_memory="1MB", kv_offload_dir=str(tmp_path))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    answers = []
    for first in (True, False):
        eng = _engine(model, **kw)
        with serving(eng) as srv:
            code, out = post(srv.port, "/v1/completions", body)
            assert code == 200, out
            answers.append(out["choices"][0]["token_ids"])
            hits = metric(
                get(srv.port, "/metrics")[1],
                "jaxkv:kv_offload_hit_tokens_total" + '{model_name="tiny",tier="disk"}',
            )
        assert (hits == 0) if first else (hits >= 8 * ((len(prompt) - 1) // 8)), hits
    assert answers[0] == answers[1] == lone(prompt, 5)


def test_the_disk_tier_trusts_no_file_in_its_folder(tmp_path, caplog):
    """Only a regular file of a page's size whose MAC is the folder key's is
    served: a FIFO (never waited on), a link to /dev/zero, a 2 GB sparse
    file and a page forged with an unkeyed checksum are each skipped with
    a log line and removed; the key is the user's alone."""
    import hashlib
    import os
    import time

    from jaxkv.core.kv.disk import KEY_FILE, DiskTier

    layout = [((2, 8, 4), "float32")]
    page = [np.arange(64, dtype=np.float32).reshape(2, 8, 4)]
    disk = DiskTier(tmp_path, "fp", layout, max_bytes=64 * 1024)
    assert (tmp_path / KEY_FILE).stat().st_mode & 0o777 == 0o600
    hashes = [bytes([i]) * 16 for i in range(5)]
    for h in hashes:
        assert disk.write(h, page)
    path = [disk._path(h.hex()) for h in hashes]
    path[1].unlink()
    os.mkfifo(path[1])
    path[2].unlink()
    path[2].symlink_to("/dev/zero")
    with open(path[3], "r+b") as f:
        f.truncate(2 << 30)
    raw = bytearray(path[4].read_bytes())
    raw[-100] ^= 1  # the forger's page, its checksum recomputed without the key
    raw[-32:] = hashlib.blake2b(bytes(raw[:-32]), digest_size=32).digest()
    path[4].write_bytes(bytes(raw))
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        got = [disk.read(h) for h in hashes]
    assert time.perf_counter() - t0 < 2
    assert np.array_equal(got[0][0], page[0]) and got[1:] == [None] * 4
    msgs = " ".join(r.getMessage() for r in caplog.records)
    for why in ("not a regular file", "unreadable", "bytes, a page file has", "MAC does not match"):
        assert why in msgs, why
    assert not any(p.exists() or p.is_symlink() for p in path[1:])
    (tmp_path / KEY_FILE).chmod(0o644)
    with pytest.raises(ValueError, match="kv_offload_dir: .*readable by other users"):
        DiskTier(tmp_path, "fp", layout, max_bytes=64 * 1024)


def test_two_engines_on_one_folder_share_one_budget(tmp_path):
    """Two tiers of different models on one folder: the folder's page bytes
    stay within the one budget, each tier's oldest files going first."""
    from jaxkv.core.kv import disk as kv_disk

    layout = [((2, 8, 4), "float32")]
    page = [np.zeros((2, 8, 4), np.float32)]
    size = kv_disk.DiskTier(tmp_path / "sizing", "fpA", layout, max_bytes=1 << 20).file_bytes
    budget = 6 * size
    a = kv_disk.DiskTier(tmp_path, "fpA", layout, max_bytes=budget)
    b = kv_disk.DiskTier(tmp_path, "fpB", layout, max_bytes=budget)
    for i in range(10):
        assert a.write(bytes([i]) * 16, page) and b.write(bytes([100 + i]) * 16, page)
        on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*" + kv_disk.SUFFIX))
        assert on_disk <= budget, (i, on_disk)
    assert 0 < len(a) and 0 < len(b) and len(a) + len(b) <= 6
    assert bytes([9]) * 16 in a and bytes([109]) * 16 in b  # the newest stay
