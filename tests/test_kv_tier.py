"""The full cache in a slower tier (cache.TieredKVCache): the committed rows live in `store` between forwards,
each forward runs on a working copy brought in by `resident()`, and its new rows go back. On this CPU the tier
is a parameter ("cpu"), and the same swap path runs as under CUDA's pinned host memory."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from verispec.cache import KVCache
from verispec.cache.kv import TieredKVCache
from verispec.config import EngineConfig, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import NgramDrafter, build_drafter
from verispec.engine.engine import Engine
from verispec.errors import ConfigError

PROMPT = [3, 4, 5, 6, 3, 4, 5, 7, 8, 9, 10, 11, 3, 4, 5, 6, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]


def test_a_tiered_cache_swaps_in_for_a_forward_and_back():
    target = tiny_model()
    cache = KVCache.for_model(target, max_len=64, tier="cpu")
    assert isinstance(cache, TieredKVCache) and cache.k is cache.store[0]
    with torch.inference_mode():
        with cache.resident():
            assert cache.k is not cache.store[0]  # the forward writes a working copy
            target(torch.tensor([PROMPT[:10]]), cache=cache, num_logits=0)
        assert cache.k is cache.store[0] and cache.length == 10
        plain = KVCache.for_model(target, max_len=64)
        target(torch.tensor([PROMPT[:10]]), cache=plain, num_logits=0)
        assert torch.equal(cache.k[:, :, :, :10], plain.k[:, :, :, :10])  # the new rows went back to the store
        cache.prefetch()
        with cache.resident():
            a, _ = target(torch.tensor([PROMPT[10:12]]), cache=cache)
        b, _ = target(torch.tensor([PROMPT[10:12]]), cache=plain)
        assert torch.equal(a, b) and torch.equal(cache.v[:, :, :, :12], plain.v[:, :, :, :12])
    assert cache.swaps["fetches"] == 2 and cache.swaps["bytes_in"] > 0 and cache.swaps["bytes_out"] > 0
    with cache.resident(), pytest.raises(RuntimeError, match="resident"):
        cache.reserve(1000)


def test_decode_and_engine_with_a_tiered_cache_equal_plain():
    target = tiny_model()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = decode(target, PROMPT, params).token_ids
    for drafter in (NgramDrafter(), build_drafter("vericache(compress=streaming,budget=12)", target=target,
                                                  dtype=target.dtype, device=target.device)):
        out = decode(target, PROMPT, params, drafter=drafter, spec=SpecConfig(k=6, kv_tier="cpu"))
        assert out.token_ids == plain
    engine = Engine(target, None, EngineConfig(k=4, kv_tier="cpu", prefill_chunk=8))
    for _ in range(3):
        engine.add_request(PROMPT, params)
    results = engine.run_until_done()
    assert [r.token_ids for r in results.values()] == [plain] * 3


def test_a_bad_tier_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_tier"):
        SpecConfig(kv_tier="disk")
    with pytest.raises(ConfigError, match="kv_tier"):
        EngineConfig(kv_tier="tape")
