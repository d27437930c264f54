"""Compiled step programs kept on disk (jaxkv.worker.program_store): a second
engine of the same model and shape loads every program without tracing
(checked by making tracing fail) and decodes the very tokens of an engine
that keeps nothing; a corrupt, truncated or foreign entry is ignored with a
log line and rebuilt; a one-device program stored in a process with several
devices loads onto its own device; a program JAX's persistent cache served
is never stored."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama
from jaxkv.worker import program_store
from jaxkv.worker.programs import Programs

CFG = ModelConfig(
    architecture="llama",
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    eos_token_ids=(),
)
OPTS = dict(num_pages=24, page_size=8, max_num_seqs=2, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def model():
    return Llama.random_init(CFG, seed=7)


@pytest.fixture(autouse=True)
def no_xla_cache():
    """Without JAX's persistent cache (the suite turns it on), whose hits
    the store does not keep."""
    import jax
    from jax._src import compilation_cache  # JAX decides once per process unless reset

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


def _tokens(eng):
    rng = np.random.default_rng(0)
    ids = [
        eng.add_request(
            [int(t) for t in rng.integers(0, 97, 5 + 7 * i)],
            SamplingParams(max_tokens=12, temperature=0.8 * (i % 2), seed=i),
        )
        for i in range(4)
    ]
    out = eng.run_to_completion()
    return [list(out[i].outputs[0].token_ids) for i in ids]


def _store(eng):
    return eng.runner.programs.store


def test_a_warm_engine_loads_every_program_without_tracing(model, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path))
    want = _tokens(LLMEngine(model, None, EngineConfig(warmup=False, program_cache=False, **OPTS)))
    assert not list(tmp_path.rglob("*.bin"))  # off keeps nothing

    cold = LLMEngine(model, None, EngineConfig(warmup=True, **OPTS))
    assert _store(cold).saved == len(cold.runner.programs.keys())
    assert _tokens(cold) == want

    def no_tracing(self, key, lowering_platforms=None):
        raise AssertionError(f"program {key} was traced on a warm start")

    monkeypatch.setattr(Programs, "lower", no_tracing)
    warm = LLMEngine(model, None, EngineConfig(warmup=True, **OPTS))
    assert _store(warm).loaded == len(warm.runner.programs.keys())
    assert _tokens(warm) == want


def test_bad_entries_are_logged_and_rebuilt(model, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path))
    want = _tokens(LLMEngine(model, None, EngineConfig(warmup=True, **OPTS)))
    files = sorted(tmp_path.rglob("*.bin"))
    assert len(files) >= 3
    head = len(program_store.MAGIC)
    damaged = {
        files[0]: b"\x00not a program" * 9,  # garbage
        files[1]: files[1].read_bytes()[:1000],  # truncated
        files[2]: (
            files[2].read_bytes()[:head]
            + (program_store.VERSION + 1).to_bytes(4, "little")
            + files[2].read_bytes()[head + 4 :]
        ),  # another format version
    }
    for f, data in damaged.items():
        f.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        eng = LLMEngine(model, None, EngineConfig(warmup=True, **OPTS))
    for f in damaged:
        assert f"stored program {f} is stale or corrupt" in caplog.text
    assert _store(eng).loaded == len(files) - 3 and _store(eng).saved == 3
    assert _tokens(eng) == want
    again = LLMEngine(model, None, EngineConfig(warmup=True, **OPTS))  # rebuilt entries load
    assert _store(again).loaded == len(files)


SCRIPT = """
import json
import numpy as np
from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama
cfg = ModelConfig(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=256, eos_token_ids=())
eng = LLMEngine(Llama.random_init(cfg, seed=7), None, EngineConfig(**json.loads(%r)))
ids = [eng.add_request([1, 2, 3, 4 + i], SamplingParams(max_tokens=6)) for i in range(3)]
out = eng.run_to_completion()
store = eng.runner.programs.store
print(json.dumps(dict(tokens=[list(out[i].outputs[0].token_ids) for i in ids],
                      loaded=store.loaded, saved=store.saved)))
"""


def test_one_device_programs_of_a_many_device_process(tmp_path):
    code = SCRIPT % json.dumps(dict(warmup=False, **OPTS))
    env = dict(
        os.environ, JAXKV_CACHE=str(tmp_path), XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )

    def run():
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["saved"] > 0 and second["loaded"] == first["saved"]
    assert second["tokens"] == first["tokens"]


TWO_ENGINES = """
import json, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxkv.config import EngineConfig, ModelConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.sampling_params import SamplingParams
from jaxkv.model.llama import Llama
cfg = ModelConfig(architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  max_position_embeddings=256, eos_token_ids=())
model, saved, loaded = Llama.random_init(cfg, seed=7), 0, 0
for _ in range(int(sys.argv[2])):  # engines one after another in this process
    eng = LLMEngine(model, None, EngineConfig(**json.loads(sys.argv[3])))
    ids = [eng.add_request([(7 * i + j) % 97 for j in range(30)], SamplingParams(max_tokens=6))
           for i in range(3)]
    out = eng.run_to_completion()
    saved += eng.runner.programs.store.saved
    loaded += eng.runner.programs.store.loaded
print(json.dumps(dict(tokens=[list(out[i].outputs[0].token_ids) for i in ids],
                      saved=saved, loaded=loaded)))
"""


def test_programs_jax_cache_served_are_never_stored(tmp_path):
    """A program JAX's persistent cache served does not serialize whole (its
    fused kernels are missing when it is loaded), so the store keeps none:
    neither at the served compile nor when JAX's in-memory cache hands the
    same executable to a second engine of the process (no cache event then:
    programs of a module-level function, as SnapKV's page compaction, lower
    to the same module in every engine). The oracle: the tokens of an engine
    that compiled everything itself."""
    opts = json.dumps(
        dict(warmup=False, kv_eviction="snapkv", kv_budget=16, snapkv_window=8, **OPTS)
    )

    def run(store, engines):
        env = dict(os.environ, JAXKV_CACHE=str(tmp_path / store))
        out = subprocess.run(
            [sys.executable, "-c", TWO_ENGINES, str(tmp_path / "xla"), str(engines), opts],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    fresh = run("a", 1)  # JAX's cache empty: every program compiled, and stored
    assert fresh["saved"] > 0
    served = run("b", 2)  # every program from JAX's cache, twice
    assert served["saved"] == 0 and served["tokens"] == fresh["tokens"]
    again = run("b", 1)  # nothing stored to load: JAX's cache serves them again
    assert again["loaded"] == 0 and again["tokens"] == fresh["tokens"]


def test_the_fingerprint_names_what_changes_a_traced_step(monkeypatch):
    """A setting read while a step is traced (JAXKV_GGUF_ROUND_X: whether GGUF
    block matmuls round x) is part of the store's fingerprint, so a program
    traced under one value is never loaded under the other."""
    import jax

    from jaxkv.model import blocks

    if jax.default_backend() != "cpu" or not blocks.available():
        pytest.skip("native CPU kernels unavailable")
    prints = {}
    for value in ("1", "0"):
        monkeypatch.setenv("JAXKV_GGUF_ROUND_X", value)
        prints[value] = program_store.platform_fingerprint()
    assert prints["1"] != prints["0"]
    assert (
        program_store.ProgramStore("/x", prints["1"]).dir
        != program_store.ProgramStore("/x", prints["0"]).dir
    )


class _Planted:
    """Unpickling it writes a marker file: what an attacker's entry would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_a_planted_entry_is_never_unpickled(tmp_path, monkeypatch, caplog):
    """A pickle planted where the store looks is never run: in a shared
    cache folder (mode 1777) the store is not used at all (a warning names
    the folder); in a private one an entry without this user's MAC, its
    checksum recomputed as an attacker would, is refused before unpickling."""
    import hashlib
    import pickle

    marker = tmp_path / "ran"
    payload = pickle.dumps((_Planted(marker), None, None, [0]))
    unkeyed = (
        program_store.MAGIC
        + program_store.VERSION.to_bytes(4, "little")
        + hashlib.sha256(payload).digest()
        + payload
    )
    private = tmp_path / "private"
    monkeypatch.setenv("JAXKV_CACHE", str(private))
    monkeypatch.setenv("JAXKV_KEY_FILE", str(tmp_path / "config" / "cache.key"))
    program_store.secret_key.cache_clear()
    store = program_store.ProgramStore.for_engine(EngineConfig(**OPTS))
    store.dir.mkdir(parents=True)
    store.path("step").write_bytes(unkeyed)
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        assert store.load("step") is None
    assert "not unpickled" in caplog.text and not marker.exists()
    assert not store.path("step").exists()  # removed, to be compiled anew
    assert oct((tmp_path / "config" / "cache.key").stat().st_mode & 0o777) == "0o600"

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    monkeypatch.setenv("JAXKV_CACHE", str(shared))
    with caplog.at_level(logging.WARNING, logger="jaxkv"):
        assert program_store.ProgramStore.for_engine(EngineConfig(**OPTS)) is None
    assert f"not using the cache folder {shared / 'programs'}" in caplog.text
    assert "writable by other users" in caplog.text
    from pallas_kernels import private_dirs

    assert "writable by other users (mode 1777)" in private_dirs.problem(shared)
    assert private_dirs.problem(private) is None
    program_store.secret_key.cache_clear()
