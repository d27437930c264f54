"""The compiled step: cache updated in place, one compile per bucket."""

import numpy as np

from jaxkv.config import CacheConfig, ModelConfig
from jaxkv.kv_cache import create_cache
from jaxkv.model import Llama
from jaxkv.runner import Buckets, Runner, SeqInput, build_batch

CFG = ModelConfig(architecture="llama", vocab_size=101, hidden_size=64, intermediate_size=128,
                  num_layers=3, num_heads=6, num_kv_heads=2, head_dim=16,
                  max_position_embeddings=512)


def test_step_updates_cache_in_place():
    runner = Runner(Llama.random_init(CFG), create_cache(CFG, CacheConfig(num_pages=512, page_size=16)),
                    Buckets.make(64, 8, 32))
    batch, greedy = build_batch([SeqInput([1, 2, 3], 0, [1])], 16, runner.buckets)
    compiled = runner._step.lower(runner.graphdef, runner.state, runner.cache, batch, runner.rng,
                                  all_greedy=greedy, num_top_logprobs=0,
                                  return_logits=False, attention=("auto", None, 0)).compile()
    ma = compiled.memory_analysis()
    cache_bytes = runner.cache.nbytes()
    assert cache_bytes >= 6 * 2**20
    # The whole cache is an input/output alias, and no temporary is anywhere
    # near its size (one layer's K is 1/6 of it).
    assert ma.alias_size_in_bytes >= cache_bytes, (ma.alias_size_in_bytes, cache_bytes)
    assert ma.temp_size_in_bytes < cache_bytes / 6, (ma.temp_size_in_bytes, cache_bytes)
    # And the donated buffers are really consumed.
    old = runner.cache.k[0]
    runner.run([SeqInput([1, 2, 3], 0, [1])])
    assert old.is_deleted()


def test_fifty_steps_in_one_bucket_compile_once():
    runner = Runner(Llama.random_init(CFG), create_cache(CFG, CacheConfig(num_pages=64, page_size=8)),
                    Buckets((16,), (4,), (8,)))
    rng = np.random.default_rng(0)
    before = runner._step._cache_size()  # the jit cache is shared by every Runner
    lens = [0, 0, 0, 0]
    tables = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15], [16, 17, 18, 19, 20]]
    for step in range(50):
        n = int(rng.integers(1, 5))
        seqs = []
        for i in range(n):
            q = int(rng.integers(1, 4))
            if lens[i] + q > 40:
                lens[i] = 0
            seqs.append(SeqInput(list(rng.integers(0, 101, q)), lens[i], tables[i]))
            lens[i] += q
        runner.run(seqs)
    assert runner._step._cache_size() - before == 1
    assert runner.compiles == 1
