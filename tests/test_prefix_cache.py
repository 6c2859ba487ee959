"""engine.prefix: prompt-prefix KV reuse across requests. Outputs equal plain decoding (fp32, bf16 native,
seeded sampling), hits are counted, eviction keeps the byte budget, drafters reading the target's hidden states take
hits with them (drafting exactly what they draft without the cache), VeriCache takes none."""

from __future__ import annotations

import pytest
import torch
from conftest import no_native_reason, tiny_model
from test_block_drafter import make_block
from test_feature_drafters import drafter_for

from verispec.cache import KVCache
from verispec.config import EngineConfig, RequestSpec, SamplingParams, TreeConfig
from verispec.decode import decode
from verispec.drafters import BlockDrafter
from verispec.engine import Engine
from verispec.engine.prefix import PrefixCache
from verispec.errors import ConfigError
from verispec.kernels import native

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
_g = torch.Generator().manual_seed(5)
SHARED = torch.randint(3, 97, (80,), generator=_g).tolist()  # 2 full blocks of 32 and a partial one
PROMPTS = [SHARED + torch.randint(3, 97, (n,), generator=_g).tolist() for n in (7, 20, 1)] + [SHARED[:40]]


def target_in(dtype: str, seed: int):
    """The tiny target in fp32, or packed bf16 on the native kernels (skipped where they are missing)."""
    if dtype == "bf16" and not native.available():
        pytest.skip(no_native_reason())
    target = tiny_model(seed)
    return target.to(torch.bfloat16).pack_weights() if dtype == "bf16" else target


def one_at_a_time(engine: Engine, prompts, params=GREEDY, spec=RequestSpec()) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        engine.add_request(p, params, spec, request_id=str(i))
        out.append(engine.run_until_done()[str(i)].token_ids)
    engine.check_idle()
    return out


def test_keys_name_the_whole_prefix():
    pc = PrefixCache(1 << 20, block=4)
    a, b = pc.keys([1, 2, 3, 4, 5, 6, 7, 8, 9]), pc.keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and len(b) == 2  # full blocks only
    assert a[1] != b[1]  # the same second block after a different first one is another prefix
    assert pc.keys([1, 2, 3, 4]) == a[:1]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_outputs_equal_plain_and_shared_blocks_are_reused(dtype):
    target = target_in(dtype, 6)
    plain = [decode(target, p, GREEDY).token_ids for p in PROMPTS]
    for drafter in (None, "ngram"):
        engine = Engine(target, None, EngineConfig(drafter=drafter, prefix_block=32))
        assert one_at_a_time(engine, PROMPTS) == plain, drafter
        # the first prompt fills the cache; the next two find both full shared blocks (64 rows); the last one
        # (40 tokens) finds the first block only
        assert engine.prefix.hit_tokens == 64 + 64 + 32
        assert engine.prefix.queried_tokens == sum(len(p) - 1 for p in PROMPTS)


def test_concurrent_requests_and_seeded_sampling_match_no_prefix_cache():
    """Requests in one batch (some arriving after others have cached their prompts), sampled with seeds: the same
    tokens as an engine without the prefix cache."""
    target = tiny_model(7)
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]

    def run(prefix_bytes):
        engine = Engine(target, None, EngineConfig(drafter="ngram", prefix_cache_bytes=prefix_bytes))
        got = {}
        for i, (p, sp) in enumerate(zip(PROMPTS * 2, params * 2)):
            engine.add_request(p, sp, RequestSpec(), request_id=str(i))
            if i % 3 == 2:
                for out in engine.step():
                    if out.result is not None:
                        got[out.request_id] = out.result.token_ids
        got.update({k: v.token_ids for k, v in engine.run_until_done().items()})
        return engine, got

    cached, with_cache = run(64 << 20)
    _, without = run(0)
    assert with_cache == without and cached.prefix.hit_tokens > 0


def test_eviction_keeps_the_byte_budget_least_recently_used_first():
    target = tiny_model(6)
    cache = KVCache.for_model(target, max_len=200)
    per_block = 2 * cache.k[:, :, :, :8].numel() * cache.k.element_size()
    pc = PrefixCache(budget_bytes=2 * per_block, block=8)
    toks = list(range(3, 40))
    cache.length = 32  # rows for toks[:32]: four blocks
    pc.store(toks, cache)
    assert len(pc.entries) == 2 and pc.nbytes == 2 * per_block  # the first two went out
    fresh = KVCache.for_model(target, max_len=200)
    assert pc.load(toks, fresh) == (0, {})  # the prefix's first block is gone, so nothing after it is usable
    with pytest.raises(ConfigError, match="prefix_cache_bytes"):
        EngineConfig(prefix_cache_bytes=-1)


def _stats(results) -> list[tuple[int, int, int]]:
    return [(r.stats.num_drafts, r.stats.num_draft_tokens, r.stats.num_accepted_tokens) for r in results]


@pytest.mark.parametrize("kind", ["block", "eagle"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_hidden_state_drafters_take_hits_with_the_context_a_prefill_gives(dtype, kind):
    """A block drafter reads the target's hidden states of the prompt: its blocks are stored with them, a later
    request of the same drafter takes the hit and its drafter gets them, drafting exactly what it drafts without
    the prefix cache (the same drafts, accepted the same, in every round); blocks a plain request stored (no
    hidden states) are no hit for it until it stores them with its own."""
    target = target_in(dtype, 6)
    model = make_block(target, head="markov", confidence=True)
    plain = [decode(target, p, GREEDY).token_ids for p in PROMPTS]
    runs = {}
    for cached in (True, False):
        drafter = BlockDrafter(model, target) if kind == "block" else drafter_for("eagle", target, TreeConfig())
        engine = Engine(target, None, EngineConfig(drafter="blk", k=4, prefix_cache_bytes=(64 << 20) * cached),
                        drafters={"blk": drafter})
        results = []
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, GREEDY, RequestSpec(), request_id=str(i))
            results.append(engine.run_until_done()[str(i)])
        engine.check_idle()
        assert [r.token_ids for r in results] == plain
        runs[cached] = (engine, results)
    engine, results = runs[True]
    assert engine.prefix.hit_tokens == 64 + 64 + 32
    assert _stats(results) == _stats(runs[False][1])
    assert all(r.stats.num_drafts > 0 for r in results)

    engine = Engine(target, None, EngineConfig(drafter="blk", k=4), drafters={"blk": BlockDrafter(model, target)})
    assert one_at_a_time(engine, PROMPTS[:1], spec=RequestSpec(drafter="none")) == plain[:1]
    assert engine.prefix.entries and all(not h for _, _, h in engine.prefix.entries.values())
    assert one_at_a_time(engine, PROMPTS[1:2]) == plain[1:2]
    assert engine.prefix.hit_tokens == 0  # rows without hidden states: no hit for the block drafter
    assert all(h for _, _, h in engine.prefix.entries.values())  # ... which stored its own with them
    assert one_at_a_time(engine, PROMPTS[2:3]) == plain[2:3]
    assert engine.prefix.hit_tokens == 64



@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_windowed_block_drafter_takes_the_kv_only_blocks_plain_requests_store(dtype):
    """A drafter whose context may have gaps (a windowed block drafter) needs no hidden states from a hit: it takes
    the blocks a plain request stored (KV only), its context restarts at the first row the prefill computes, and it
    drafts from there; outputs equal plain decoding. A prompt whose blocks cover all but its last token still leaves
    a row before the anchor to restart at (one block less is copied)."""
    target = target_in(dtype, 6)
    model = make_block(target, head="markov", confidence=True)
    whole = SHARED[:64] + [5]  # 65 tokens: its two full blocks are all but the anchor
    prompts = [*PROMPTS, whole]
    plain = [decode(target, p, GREEDY).token_ids for p in prompts]
    engine = Engine(target, None, EngineConfig(drafter="blk", k=4),
                    drafters={"blk": BlockDrafter(model, target, context_window=8)})
    assert engine.drafter("blk").capabilities.context_gaps
    assert one_at_a_time(engine, prompts[:1], spec=RequestSpec(drafter="none")) == plain[:1]
    results = []
    for i, p in enumerate(prompts[1:], start=1):
        engine.add_request(p, GREEDY, RequestSpec(), request_id=str(i))
        results.append(engine.run_until_done()[str(i)])
    engine.check_idle()
    assert [r.token_ids for r in results] == plain[1:]
    # both shared blocks for the next two prompts, the first for the 40-token one, one (not two) for `whole`
    assert engine.prefix.hit_tokens == 64 + 64 + 32 + 32
    assert all(not h for _, _, h in engine.prefix.entries.values())  # nothing stored beside the KV
    assert all(r.stats.num_drafts > 0 for r in results)

def test_vericache_takes_no_copied_rows():
    """VeriCache's compressed view follows the rows the target's forwards write: its requests prefill in full."""
    target = tiny_model(6)
    engine = Engine(target, None, EngineConfig(drafter="vericache(compress=streaming, budget=12, sinks=2)", k=4))
    plain = [decode(target, p, GREEDY).token_ids for p in PROMPTS[:2]]
    assert one_at_a_time(engine, PROMPTS[:2]) == plain
    assert engine.prefix.hit_tokens == 0 and engine.prefix.entries


def test_store_adds_hidden_states_to_blocks_stored_without_them():
    target = tiny_model(6)
    cache = KVCache.for_model(target, max_len=64)
    cache.length = 24
    pc = PrefixCache(budget_bytes=1 << 20, block=8)
    toks = list(range(3, 30))
    pc.store(toks, cache)
    kv_bytes = pc.nbytes
    hidden = {2: torch.randn(20, 5)}  # positions 4..23: covers the blocks at 8 and 16 only
    pc.store(toks, cache, hidden, start=4)
    layers = [set(h) for _, _, h in pc.entries.values()]
    assert layers == [set(), {2}, {2}] and pc.nbytes == kv_bytes + 2 * 8 * 5 * 4
    fresh = KVCache.for_model(target, max_len=64)
    assert pc.load(toks, fresh, (2,)) == (0, {})  # the first block has none: nothing after it is usable
    pc.store(toks, cache, {2: torch.randn(24, 5)})
    n, h = pc.load(toks, fresh, (2,))
    assert n == 24 and h[2].shape == (24, 5) and torch.equal(h[2][8:], hidden[2][4:])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_copied_rows_equal_the_rows_a_prefill_writes(dtype):
    """After a hit, the request's cache holds, for its whole prompt, what one prefill of that prompt writes
    (bit for bit on the native kernels): the copied blocks and the rows computed after them."""
    target = target_in(dtype, 8)
    engine = Engine(target, None, EngineConfig(drafter=None))
    one_at_a_time(engine, PROMPTS[:1])
    prompt = PROMPTS[1]
    engine.add_request(prompt, GREEDY, RequestSpec(), request_id="b")
    engine.step()  # admitted with 64 copied rows, the rest prefilled, the first token out
    (req,) = engine.running
    assert engine.prefix.hit_tokens == 64
    ref = KVCache.for_model(target, max_len=len(prompt))
    with torch.inference_mode():
        target(torch.tensor([prompt]), cache=ref, num_logits=0)
    n = len(prompt)
    assert torch.equal(req.cache.k[:, :, :, :n], ref.k[:, :, :, :n])
    assert torch.equal(req.cache.v[:, :, :, :n], ref.v[:, :, :, :n])
    engine.run_until_done()
