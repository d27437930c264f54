"""The cache's page copy (copy-on-write) against numpy, directly and through
the runner's fixed-width program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.config import CacheConfig, ModelConfig
from jaxkv.model.attention import AttentionSpec
from jaxkv.model.kv_cache import copy_pages, create_cache
from jaxkv.model.llama import Llama
from jaxkv.worker.buckets import Buckets
from jaxkv.worker.runner import COPY_WIDTH, Runner

CFG = ModelConfig(
    architecture="llama",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def random_cache(kv_dtype, num_pages=300):
    cache = create_cache(CFG, CacheConfig(num_pages=num_pages, page_size=4, kv_dtype=kv_dtype))
    keys = iter(jax.random.split(jax.random.key(0), 100))
    fill = lambda x: (
        jax.random.randint(next(keys), x.shape, -127, 128).astype(x.dtype)  # noqa: E731
        if x.dtype == jnp.int8
        else jax.random.normal(next(keys), x.shape, x.dtype)
    )
    return jax.tree_util.tree_map(fill, cache)


def numpy_copy(cache, pairs):
    want = jax.tree_util.tree_map(lambda x: np.array(x), cache)
    for leaf in jax.tree_util.tree_leaves(want):
        src = leaf[:, [p[0] for p in pairs]].copy()
        leaf[:, [p[1] for p in pairs]] = src
    return want


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_copy_pages_matches_numpy(kv_dtype):
    cache = random_cache(kv_dtype)
    pairs = [(3, 10), (7, 11), (10, 12)]  # a destination may be another pair's source
    want = numpy_copy(cache, pairs)
    got = copy_pages(cache, jnp.asarray([p[0] for p in pairs]), jnp.asarray([p[1] for p in pairs]))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert len(jax.tree_util.tree_leaves(got)) == (8 if kv_dtype == "int8" else 4)


def test_runner_copies_more_pairs_than_one_call_holds():
    cache = random_cache("float32")
    pairs = [(i, 150 + i) for i in range(1, COPY_WIDTH + 20)]
    want = numpy_copy(cache, pairs)
    runner = Runner(Llama.random_init(CFG), cache, Buckets.make(4, 16, 8, 32), AttentionSpec())
    runner.copy_pages(pairs)
    for g, w in zip(jax.tree_util.tree_leaves(runner.cache), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert runner.compiled == [("copy", COPY_WIDTH)]
