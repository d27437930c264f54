"""int8 KV cache on the real model against the bfloat16 cache: the mean
log-likelihood of a fixed text barely moves and greedy outputs stay close.
(The full 16 prompts x 64 tokens measurement is `scripts/quality.py`; this
CI check runs 8 x 24.)"""

from tests.quality_utils import agreement, greedy_outputs, mean_loglik


def test_int8_kv_cache_log_likelihood_close(smollm2):
    model, tok = smollm2
    ll = {d: mean_loglik(model, tok, d) for d in ("float32", "bfloat16", "int8")}
    # Measured: f32 -3.9533, bf16 -3.9536, int8 -3.9583 nats/token (-3.9646
    # before keys were smoothed per channel: the bound catches that regression).
    assert abs(ll["bfloat16"] - ll["float32"]) < 0.005, ll
    assert abs(ll["int8"] - ll["bfloat16"]) < 0.008, ll
    assert ll["int8"] != ll["bfloat16"]  # the int8 path really quantizes


def test_int8_kv_cache_greedy_outputs_close(smollm2):
    model, tok = smollm2
    bf16 = greedy_outputs(model, tok, 8, 24, kv_dtype="bfloat16")
    int8 = greedy_outputs(model, tok, 8, 24, kv_dtype="int8")
    same, prefix = agreement(bf16, int8)
    print(f"int8 vs bf16 KV, 8 prompts x 24 tokens: {same} identical, mean prefix {prefix:.3f}")
    assert prefix >= 0.6, (same, prefix)
