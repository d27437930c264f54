"""The compiled step: cache updated in place, one compile per program."""

import numpy as np

from jaxkv.config import CacheConfig, ModelConfig
from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import create_cache
from jaxkv.model.llama import Llama
from jaxkv.worker.buckets import Buckets, ProgramKey
from jaxkv.worker.runner import Runner
from jaxkv.worker.scoring import plan_for
from tests.helpers.compile_count import count_compiles

CFG = ModelConfig(
    architecture="llama",
    vocab_size=101,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=6,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)


def test_step_updates_cache_in_place():
    runner = Runner(
        Llama.random_init(CFG),
        create_cache(CFG, CacheConfig(num_pages=2048, page_size=16)),
        Buckets.make(8, 64, 32, 512),
        AttentionSpec(),
    )
    plan = plan_for([([1, 2, 3], 0, [1])])
    key = runner.key_for(plan)
    compiled = runner.lower(key).compile()
    ma = compiled.memory_analysis()
    cache_bytes = runner.cache.nbytes()
    assert cache_bytes >= 24 * 2**20
    # The whole cache is an input/output alias, and no temporary is anywhere
    # near its size (one layer's K is 1/6 of it).
    assert ma.alias_size_in_bytes >= cache_bytes, (ma.alias_size_in_bytes, cache_bytes)
    assert ma.temp_size_in_bytes < cache_bytes / 6, (ma.temp_size_in_bytes, cache_bytes)
    # And the donated buffers are really consumed.
    old = runner.cache.k[0]
    runner.step(plan)
    assert old.is_deleted()


def test_fifty_steps_in_one_bucket_compile_once():
    buckets = Buckets(decode_seqs=(4,), mixed=((16, 4),), pages_per_seq=8, history=(64,))
    runner = Runner(
        Llama.random_init(CFG),
        create_cache(CFG, CacheConfig(num_pages=64, page_size=8)),
        buckets,
        AttentionSpec(),
    )
    rng = np.random.default_rng(0)
    keys = set()
    with count_compiles() as compiles:
        _fifty_steps(runner, buckets, rng, keys)
    assert keys == {ProgramKey("mixed", 16, 4)}
    assert runner.compiled == [ProgramKey("mixed", 16, 4)]
    assert len(compiles) == 1, compiles


def _fifty_steps(runner, buckets, rng, keys):
    lens = [0, 0, 0, 0]
    tables = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18, 19, 20]]
    for _step in range(50):
        n = int(rng.integers(1, 5))
        seqs = []
        for i in range(n):
            q = int(rng.integers(2, 4))
            if lens[i] + q > 40:
                lens[i] = 0
            seqs.append((list(rng.integers(0, 101, q)), lens[i], tables[i]))
            lens[i] += q
        plan = plan_for(seqs)
        keys.add(runner.key_for(plan))
        runner.step(plan)
