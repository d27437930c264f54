"""Multi-LoRA serving against Hugging Face transformers + peft: random small
PEFT adapters (every target, ranks 2-8, rsLoRA, an alpha pattern) over a
tiny random model; each adapter's greedy tokens, mixed in one batch with
the base model and with each other, equal peft's generate (unmerged, and
merged for one); slots shared by more adapters than they hold, under
preemption and prefix hits; adapters added and removed while requests run;
tensor parallel 2 with replicated KV heads; no compile after warm-up while
adapters change; bad adapters refused by name, the other requests served."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.compile_count import count_compiles
from tests.helpers.model_utils import make_hf_model

pytestmark = pytest.mark.xdist_group("lora")

ROOT = Path(__file__).resolve().parents[3]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (targets, r, alpha, extra LoraConfig options)
ADAPTERS = [
    (["q_proj", "v_proj"], 4, 8, {}),
    (ALL, 8, 16, {}),
    (["o_proj", "down_proj"], 2, 3, dict(use_rslora=True)),
    (["k_proj", "gate_proj", "up_proj"], 8, 4, dict(alpha_pattern={"k_proj": 32})),
]
PROMPTS = [[1, 5, 9, 17, 33, 2 + k, 40, 41, 42, 7] * (1 + k % 2) for k in range(4)]
MAX_TOKENS = 8


def make_adapters(kind: str, tmp: Path, specs=ADAPTERS, **model_overrides):
    """(HF base model, its folder, [(peft model, adapter folder)]): random
    adapters (lora_B nonzero, factors scaled up so each changes the greedy
    answer), each over its own copy of the base weights."""
    import peft
    import torch

    hf, path = make_hf_model(kind, tmp / "base", **model_overrides)
    out = []
    for j, (targets, r, alpha, extra) in enumerate(specs):
        copy, _ = make_hf_model(kind, tmp / f"copy{j}", **model_overrides)
        torch.manual_seed(100 + j)
        cfg = peft.LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, **extra
        )
        pm = peft.get_peft_model(copy, cfg)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.mul_(3.0)
        pm.save_pretrained(tmp / f"adapter{j}")
        out.append((pm.eval(), tmp / f"adapter{j}"))
    return hf, path, out


def hf_greedy(model, ids, n: int = MAX_TOKENS) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_llama")
    hf, path, adapters = make_adapters("llama", tmp)
    want = {
        (k, j): hf_greedy(hf if j < 0 else adapters[j][0], p)
        for k, p in enumerate(PROMPTS)
        for j in range(-1, len(adapters))
    }
    return path, [a for _, a in adapters], want, [m for m, _ in adapters] + [hf]


def engine(path, **options):
    from checkpoints.loader import load_model
    from jaxkv.config import EngineConfig
    from jaxkv.core.engine import LLMEngine

    module, _ = load_model(str(path))
    base = dict(
        warmup=False, num_pages=64, max_num_seqs=8, enable_lora=True, max_loras=4, max_lora_rank=8
    )
    base.update(options)
    return LLMEngine(module, None, EngineConfig(**base))


def run(eng, jobs, params=None):
    """Final outputs of (prompt ids, lora_request) jobs, added together."""
    from jaxkv.core.sampling_params import SamplingParams

    sp = params or SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request({"prompt_token_ids": p}, sp, lora_request=lr) for p, lr in jobs]
    fin = eng.run_to_completion()
    return [fin[i] for i in ids]


def req(folders, j):
    from jaxkv.core.adapters.lora import LoRARequest

    return None if j < 0 else LoRARequest(f"adapter{j}", j + 1, str(folders[j]))


def test_four_adapters_and_the_base_in_one_batch_equal_peft(llama):
    path, folders, want, models = llama
    eng = engine(path)
    jobs = [(k, j) for k in range(len(PROMPTS)) for j in range(-1, 4)]
    outs = run(eng, [(PROMPTS[k], req(folders, j)) for k, j in jobs])
    got = {kj: list(o.outputs[0].token_ids) for kj, o in zip(jobs, outs)}
    assert got == {kj: want[kj] for kj in jobs}
    for j in range(4):  # each adapter changes some answer: the comparison can fail
        assert any(want[(k, j)] != want[(k, -1)] for k in range(len(PROMPTS))), j
    merged = models[1].merge_and_unload()  # merged weights: the same tokens
    assert hf_greedy(merged, PROMPTS[0]) == got[(0, 1)]


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_other_families_equal_peft(kind, tmp_path):
    hf, path, adapters = make_adapters(kind, tmp_path, specs=[(ALL, 4, 8, {})])
    eng = engine(path, max_loras=1)
    folders = [a for _, a in adapters]
    outs = run(eng, [(p, req(folders, j)) for p in PROMPTS[:2] for j in (-1, 0)])
    want = [hf_greedy(hf if j < 0 else adapters[0][0], p) for p in PROMPTS[:2] for j in (-1, 0)]
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert want[0] != want[1] or want[2] != want[3]


def test_more_adapters_than_slots_under_preemption_and_prefix_hits(llama):
    path, folders, want, models = llama
    # 2 slots for 4 adapters; a pool that preempts; every prompt twice per adapter.
    eng = engine(path, max_loras=2, num_pages=14, page_size=4, max_num_batched_tokens=32)
    jobs = [(k, j) for _ in range(2) for k in range(len(PROMPTS)) for j in (-1, 0, 1, 2, 3)]
    outs = run(eng, [(PROMPTS[k], req(folders, j)) for k, j in jobs])
    assert [list(o.outputs[0].token_ids) for o in outs] == [want[kj] for kj in jobs]
    assert eng.scheduler.num_preemptions > 0
    assert eng.loras.stats["slot_loads"] > 2  # slots were rewritten
    # A new prompt's pages serve the same adapter again, never another
    # adapter or the base model.
    q = list(range(60, 78))
    firsts = [run(eng, [(q, req(folders, 0))])[0]]
    outs = [run(eng, [(q, req(folders, j))])[0] for j in (0, 2, -1)]
    assert [o.num_cached_tokens for o in outs] == [16, 0, 0]
    for o, j in zip(firsts + outs, (0, 0, 2, -1)):
        assert list(o.outputs[0].token_ids) == hf_greedy(models[j], q)  # [-1]: the base


def test_adapters_added_and_removed_while_requests_run(llama):
    from jaxkv.core.sampling_params import SamplingParams

    path, folders, want, _ = llama
    eng = engine(path, max_loras=2)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = eng.add_request({"prompt_token_ids": PROMPTS[0]}, sp, lora_request=req(folders, 0))
    eng.step()  # its prompt ran: it holds a slot
    assert eng.get_request(first).lora_slot > 0
    assert eng.loras.remove("adapter0")  # removed while its request runs: that one goes on
    gone = eng.add_request({"prompt_token_ids": PROMPTS[1]}, sp, lora_request="adapter0")
    late = eng.add_request({"prompt_token_ids": PROMPTS[2]}, sp, lora_request=req(folders, 3))
    by_name = eng.add_request({"prompt_token_ids": PROMPTS[3]}, sp, lora_request="adapter3")
    fin = eng.run_to_completion()
    assert fin[first].finished and list(fin[first].outputs[0].token_ids) == want[(0, 0)]
    assert fin[gone].outputs[0].finish_reason == "error"
    assert "unknown adapter 'adapter0'" in fin[gone].error
    assert list(fin[late].outputs[0].token_ids) == want[(2, 3)]
    assert list(fin[by_name].outputs[0].token_ids) == want[(3, 3)]


def test_no_compile_after_warm_up_while_adapters_change(llama):
    path, folders, want, _ = llama
    eng = engine(path, warmup=True, max_loras=2, max_num_batched_tokens=64)
    warmed = set(eng.runner.compiled)
    with count_compiles() as compiles:
        jobs = [(k, j) for k in range(len(PROMPTS)) for j in (3, -1, 2, 1, 0)]
        outs = run(eng, [(PROMPTS[k], req(folders, j)) for k, j in jobs])
    assert [list(o.outputs[0].token_ids) for o in outs] == [want[kj] for kj in jobs]
    assert eng.loras.stats["slot_loads"] >= 4
    assert compiles == [], f"{len(compiles)} XLA compiles after warm-up"
    assert set(eng.runner.compiled) == warmed


def _folder(tmp, name, config: dict, tensors: dict | None = None):
    from safetensors.numpy import save_file

    d = tmp / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def test_bad_adapters_are_refused_by_name_and_the_rest_served(llama, tmp_path):
    """Every hostile folder of scripts/probe/adapters.py (and the plain
    mistakes) errors its own prompt only, naming the problem, quickly; the
    prompts beside them are served as peft serves them."""
    import time

    from checkpoints import load_config
    from jaxkv.core.adapters.lora import LoRARequest
    from scripts.probe.adapters import hostile_adapters

    path, folders, want, _ = llama
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    f32 = lambda *s: np.ones(s, np.float32)  # noqa: E731
    lora = dict(peft_type="LORA", r=4, lora_alpha=8, target_modules=["q_proj"])
    bad = [
        (
            "rank 16 exceeds max_lora_rank 8",
            _folder(
                tmp_path, "rank", lora, {key.format("A"): f32(16, 64), key.format("B"): f32(64, 16)}
            ),
        ),
        (
            "fit the base projection",
            _folder(
                tmp_path, "shape", lora, {key.format("A"): f32(4, 32), key.format("B"): f32(64, 4)}
            ),
        ),
        (
            "unknown target modules ['embed_tokens']",
            _folder(tmp_path, "target", dict(lora, target_modules=["q_proj", "embed_tokens"]), {}),
        ),
        ("adapter_model.safetensors not found", _folder(tmp_path, "nofile", lora)),
        ("adapter_config.json not found", tmp_path / "missing"),
        ("modules_to_save", _folder(tmp_path, "save", dict(lora, modules_to_save=["lm_head"]))),
    ] + [
        (words, d)
        for d, words in hostile_adapters(tmp_path / "hostile", load_config(path)).values()
    ]
    eng = engine(path)
    jobs = [(PROMPTS[0], LoRARequest(f"bad{i}", 10 + i, str(d))) for i, (_, d) in enumerate(bad)]
    jobs += [(PROMPTS[1], req(folders, 1)), (PROMPTS[2], "never-loaded"), (PROMPTS[3], None)]
    t0 = time.perf_counter()
    outs = run(eng, jobs)
    assert time.perf_counter() - t0 < 30  # no backtracking pattern, no gigabyte read
    for o, (why, d) in zip(outs, bad):
        assert o.outputs[0].finish_reason == "error" and why in o.error, (d, why, o.error)
    assert "unknown adapter 'never-loaded'" in outs[-2].error
    assert list(outs[-3].outputs[0].token_ids) == want[(1, 1)]
    assert list(outs[-1].outputs[0].token_ids) == want[(3, -1)]
    off = engine(path, enable_lora=False)
    o = run(off, [(PROMPTS[0], req(folders, 0))])[0]
    assert o.outputs[0].finish_reason == "error" and "enable_lora" in o.error


def test_host_copies_are_bounded_at_their_own_rank_and_freed_on_unload(llama, tmp_path):
    """`max_cpu_loras` adapters' factors held at their own rank (no view of
    a max-rank array); an adapter dropped from the host cache is read again
    when named and gives the same tokens; unloading frees its factors."""
    from jaxkv.core.adapters.lora import LoRARequest

    path, folders, want, _ = llama
    eng = engine(path, max_loras=1, max_cpu_loras=2)
    loras = eng.loras
    reqs = [LoRARequest(f"a{j}", j + 1, str(folders[j])) for j in range(len(folders))]
    for r in reqs:
        loras.resolve(r)
    assert len(loras._held) == 2 and loras.stats["folder_reads"] == len(reqs)
    for name in loras._held:
        w = loras.known[name].weights
        assert all(x.base is None for x in (*w.a.values(), *w.b.values()))
        assert all(x.shape[-1] == w.rank for x in w.a.values())
    cold = [n for n in loras.known if loras.known[n].weights is None]
    assert cold == ["a0", "a1"]
    out = run(eng, [(PROMPTS[0], "a0"), (PROMPTS[1], "a1")])
    assert [list(o.outputs[0].token_ids) for o in out] == [want[(0, 0)], want[(1, 1)]]
    assert loras.stats["folder_reads"] == len(reqs) + 2  # each read again once
    for r in reqs:
        assert loras.remove(r.lora_name)
    assert loras.held_bytes() == 0 and not loras.known


TP_WORKER = """
import json, sys
from checkpoints.loader import load_model
from jaxkv.config import EngineConfig
from jaxkv.core.engine import LLMEngine
from jaxkv.core.adapters.lora import LoRARequest
from jaxkv.core.sampling_params import SamplingParams
path, folders, prompts = json.loads(sys.argv[1])
module, _ = load_model(path)
eng = LLMEngine(module, None, EngineConfig(warmup=False, num_pages=64, max_num_seqs=8,
                tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8))
sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ids = [eng.add_request({"prompt_token_ids": p}, sp,
                       lora_request=None if j < 0 else LoRARequest(f"a{j}", j + 1, folders[j]))
       for p in prompts for j in range(-1, len(folders))]
fin = eng.run_to_completion()
print(json.dumps([list(map(int, fin[i].outputs[0].token_ids)) for i in ids]))
"""


def test_tensor_parallel_2_with_replicated_kv_heads_equals_peft(tmp_path):
    # One KV head over 2 shards: each shard holds a replica, so the k and v
    # factors' columns must follow the replicas.
    specs = [(ALL, 4, 8, {}), (["k_proj", "v_proj", "down_proj"], 8, 16, {})]
    hf, path, adapters = make_adapters("llama", tmp_path, specs=specs, num_key_value_heads=1)
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    arg = json.dumps([str(path), [str(a) for _, a in adapters], PROMPTS[:2]])
    proc = subprocess.run(
        [sys.executable, "-c", TP_WORKER, arg],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=85,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = [
        hf_greedy(hf if j < 0 else adapters[j][0], p) for p in PROMPTS[:2] for j in range(-1, 2)
    ]
    assert got == want


@pytest.mark.parametrize("path", ["grouped_native", "ragged_dot", "masked"])
def test_each_way_of_computing_the_update_equals_a_float64_reference(path):
    import jax.numpy as jnp

    from jaxkv.config import ModelConfig
    from jaxkv.model.lora import LoRAStack, Rows

    cfg = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        eos_token_ids=(),
    )
    M, R, T = 3, 4, 11
    stack = LoRAStack(cfg, M, R)
    rng = np.random.default_rng(0)
    layer = stack.layers[0]
    for name in ("a_qkv", "b_q", "b_k", "b_v", "a_down", "b_down"):
        var = getattr(layer, name)
        var[...] = jnp.asarray(rng.standard_normal(var[...].shape), jnp.float32)
    slots = np.array([0, 2, 1, 3, 0, 2, 2, 1, 0, 3, 1], np.int32)
    x = rng.standard_normal((T, 32)).astype(np.float32)
    rows = stack.rows(jnp.asarray(slots), jnp.float32, None if path != "masked" else "mesh", "cpu")
    if path == "ragged_dot":
        rows = Rows(
            rows.order,
            rows.back,
            rows.sizes,
            rows.used,
            rows.in_order,
            rows.mask,
            grouped=True,
            native=False,
        )
    assert rows.grouped == (path != "masked")
    assert path == "masked" or rows.native == (path == "grouped_native")
    got = np.asarray(stack("qkv", 0, jnp.asarray(x), rows))
    a = np.asarray(layer.a_qkv[...], np.float64)
    want = np.zeros((T, 64))
    for t, s in enumerate(slots):
        if s:
            h = x[t].astype(np.float64) @ a[s - 1]
            b = [np.asarray(getattr(layer, f"b_{n}")[...][s - 1], np.float64) for n in "qkv"]
            want[t] = np.concatenate([h[p * R : (p + 1) * R] @ b[p] for p in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(want).max() > 1 and not want[slots == 0].any()
    none = stack.rows(jnp.zeros(T, jnp.int32), jnp.float32, None if rows.grouped else "mesh", "cpu")
    assert not np.asarray(stack("qkv", 0, jnp.asarray(x), none)).any()  # skipped: zeros


def test_a_request_waiting_for_a_slot_lets_those_after_it_start(llama):
    from jaxkv.core.sampling_params import SamplingParams
    from jaxkv.core.sequence import Status

    path, folders, want, _ = llama
    eng = engine(path, max_loras=1)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    jobs = [(0, 0), (1, 1), (2, -1), (3, 0)]  # adapter 1 waits for adapter 0's slot
    ids = [
        eng.add_request({"prompt_token_ids": PROMPTS[k]}, sp, lora_request=req(folders, j))
        for k, j in jobs
    ]
    eng.step()
    status = [eng.get_request(i).status for i in ids]
    assert status == [Status.RUNNING, Status.WAITING, Status.RUNNING, Status.RUNNING]
    assert list(eng.scheduler.waiting) == [eng.get_request(ids[1])]
    fin = eng.run_to_completion()
    assert [list(fin[i].outputs[0].token_ids) for i in ids] == [want[kj] for kj in jobs]
