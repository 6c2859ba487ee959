"""The native forward's bound caches (model.fused: FusedForward.binding, and FusedFeature.binding for a feature
drafter's steps): a cache is described to decoder.c once and every later forward over it reuses that description,
so they must give exactly what a forward that checks and describes the cache afresh gives, notice a cache whose
tensors were replaced, keep no cache alive, and still refuse rows past a cache's capacity."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from conftest import no_native_reason, tiny_model
from verispec.cache import KVCache, PackedBatch
from verispec.kernels import native
from verispec.model.fused import FusedFeature, FusedForward

needs_native = pytest.mark.skipif(not native.available(), reason=no_native_reason())
TOKENS = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(5))


def _steps(model, cache: KVCache) -> list[torch.Tensor]:
    """A prefill, one-token steps, a 5-row verify rolled back to 2 rows, and more steps: each forward's logits. Then
    the cache compressed (rows dropped and evicted, so positions run ahead of rows), grown, and stepped again, in a
    resident() block each as a tiered cache needs."""
    def step(tokens: torch.Tensor) -> torch.Tensor:
        with cache.resident():
            return model(tokens, cache=cache)[0]

    out = [step(TOKENS[:, :12])]
    out += [step(TOKENS[:, i : i + 1]) for i in range(12, 16)]
    out.append(step(TOKENS[:, 16:21]))
    cache.truncate(18)
    out += [step(TOKENS[:, i : i + 1]) for i in range(18, 24)]
    out.append(step(TOKENS[:, 24:34:2]))  # tokens that are not contiguous
    cache.drop_front(4)
    cache.evict(1, 2)
    out += [step(TOKENS[:, i : i + 1]) for i in range(34, 37)]
    cache.resize(48)
    out += [step(TOKENS[:, 37:40]), step(TOKENS[:, 40:41])]
    return out


@pytest.fixture
def bound_calls(monkeypatch) -> list[int]:
    """Counts forwards that took the bound path (native.Decoder.forward_bound): a test that compares outputs only
    would pass with the path never taken."""
    calls = []
    run = native.Decoder.forward_bound

    def counted(self, *args, **kwargs):
        calls.append(1)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(native.Decoder, "forward_bound", counted)
    return calls


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tier", [None, "cpu"])
def test_bound_forwards_equal_forwards_that_describe_the_cache_afresh(dtype, tier, bound_calls, monkeypatch):
    model = tiny_model(1).to(dtype).pack_weights()
    assert model.matmuls == "native"
    with torch.inference_mode():
        bound = _steps(model, KVCache.for_model(model, max_len=40, tier=tier))
        assert len(bound_calls) == len(bound)
        assert len(model.fused._bindings) == 0  # the cache died with _steps' frame: its binding went with it
        monkeypatch.setattr(FusedForward, "binding", lambda self, cache: None)
        afresh = _steps(model, KVCache.for_model(model, max_len=40, tier=tier))
    assert len(bound_calls) == len(bound)
    assert all(torch.equal(a, b) for a, b in zip(bound, afresh))


@needs_native
def test_a_cache_whose_tensors_are_replaced_is_bound_anew():
    model = tiny_model(2)
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=16)
        model(TOKENS[:, :14], cache=cache)
        first = model.fused.binding(cache)
        assert first is not None and model.fused.binding(cache) is first  # reused while nothing changed
        # Grown in place of the old tensors (as a cache that reserves room would): the old binding's capacity of 16
        # would refuse the next rows, and its pointers would name freed memory.
        k, v = (torch.zeros(*t.shape[:3], 40, t.shape[4]) for t in (cache.k, cache.v))
        k[..., :16, :], v[..., :16, :] = cache.k, cache.v
        cache.k, cache.v = k, v
        grown = model(TOKENS[:, 14:30], cache=cache)[0]
        assert model.fused.binding(cache) is not first
        reference = KVCache.for_model(model, max_len=40)
        model(TOKENS[:, :14], cache=reference)
        assert torch.equal(grown, model(TOKENS[:, 14:30], cache=reference)[0])


@needs_native
def test_a_binding_keeps_no_cache_alive():
    model = tiny_model(0)
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=20)
        model(TOKENS[:, :5], cache=cache)
        assert model.fused.binding(cache) is not None
        alive, tensor = weakref.ref(cache), weakref.ref(cache.k)
        del cache
        gc.collect()
    assert alive() is None and tensor() is None and len(model.fused._bindings) == 0


@needs_native
def test_a_bound_cache_still_refuses_rows_past_its_capacity():
    model = tiny_model(0)
    with torch.inference_mode():
        cache = KVCache.for_model(model, max_len=10)
        model(TOKENS[:, :8], cache=cache)
        assert model.fused.binding(cache) is not None
        with pytest.raises(ValueError, match="overflow"):
            model(TOKENS[:, 8:11], cache=cache)
        assert cache.length == 8
        model(TOKENS[:, 8:10], cache=cache)  # exactly full is fine
        assert cache.length == 10


@needs_native
def test_packed_forwards_over_bound_caches_equal_forwards_that_describe_them_afresh(bound_calls, monkeypatch):
    model = tiny_model(4)

    def run() -> list[torch.Tensor]:
        caches = [KVCache.for_model(model, max_len=32) for _ in range(3)]
        for i, cache in enumerate(caches):  # prompts of different lengths
            model(TOKENS[:, i : i + 6 + 2 * i], cache=cache, num_logits=0)
        out = []
        for lengths in ([1, 1, 1], [3, 1, 5], [1, 2, 1]):
            batch = PackedBatch.build(caches, lengths, torch.device("cpu"))
            tokens = torch.cat([TOKENS[0, 20 + i : 20 + i + n] for i, n in enumerate(lengths)])
            rows = torch.tensor([s.start + s.length - 1 for s in batch.segments])
            out.append(model.forward_packed(tokens, batch, rows, hidden_layers=(1,))[0])
        return out

    with torch.inference_mode():
        bound = run()
        assert len(bound_calls) == 3 + 3  # the prompts, then the three packed steps
        monkeypatch.setattr(FusedForward, "binding", lambda self, cache: None)
        afresh = run()
    assert len(bound_calls) == 6
    assert all(torch.equal(a, b) for a, b in zip(bound, afresh))


@needs_native
@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_feature_drafter_steps_over_bound_caches_equal_steps_that_describe_them_afresh(kind, bound_calls,
                                                                                       monkeypatch):
    """A feature drafter's native steps (FusedFeature: input stage, layer, head) over its own caches, bound or not:
    the same drafts and cache entries bit for bit over greedy rounds of two requests with a sliding window."""
    from test_feature_drafters import GREEDY, PROMPTS, make_feature

    from verispec.drafters import DraftRequest, Verified
    from verispec.drafters.feature import FeatureDrafter

    target = tiny_model(0)
    model = make_feature(target, kind, 4, packed=True)
    layers = FeatureDrafter(model, target, context_window=4).capabilities.hidden_layers

    def rounds() -> list:
        drafter = FeatureDrafter(model, target, context_window=4)
        tokens = [list(p) for p in PROMPTS[:2]]
        out = []
        for sid, p in enumerate(tokens):
            _, hidden = target(torch.tensor([p]), hidden_layers=layers)
            drafter.start(sid, p)
            drafter.observe(sid, 0, {k: v[0, :-1] for k, v in hidden.items()})
        for _ in range(5):
            drafts = drafter.propose([DraftRequest(sid, tokens[sid], 4, GREEDY, None) for sid in range(2)])
            for sid, d in enumerate(drafts):
                committed = [*d.tokens[:2], 7]  # two accepted, then a token of the target's
                _, hidden = target(torch.tensor([tokens[sid] + committed[:2]]), hidden_layers=layers)
                drafter.accept(Verified(sid, 2, committed, {k: v[0, len(tokens[sid]) - 1 :]
                                                            for k, v in hidden.items()}))
                tokens[sid] += committed
                cache = drafter._caches[sid]
                n = cache.length
                out.append((d.tokens, cache.k[:, :, :, :n].clone(), cache.v[:, :, :, :n].clone()))
        return out

    with torch.inference_mode():
        bound = rounds()
        taken = len(bound_calls)  # the drafter's steps only: the target's forwards here have no cache (torch path)
        assert taken > 0
        monkeypatch.setattr(FusedFeature, "binding", lambda self, cache: None)
        afresh = rounds()
    assert len(bound_calls) == taken and len(bound) == len(afresh)
    for (ta, ka, va), (tb, kb, vb) in zip(bound, afresh):
        assert ta == tb and torch.equal(ka, kb) and torch.equal(va, vb)
