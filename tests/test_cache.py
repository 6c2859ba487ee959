"""KVCache semantics (write / advance / truncate / overflow) and rollback exactness with a model: a cache that
was extended and truncated back computes exactly what a fresh cache computes, including the draft model's
cache inside ModelDrafter across partially accepted rounds."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import tiny_model

from verispec.cache import KVCache, causal_mask, tree_mask, tree_positions
from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import ModelDrafter
from verispec.drafters.base import Draft, DraftRequest, Verified

L, H, D, T_MAX = 2, 2, 4, 8


def _kv(t: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((1, H, t, D), fill)
    return k, -k


def test_write_advance_truncate_semantics():
    """write places entries after the committed ones and returns views up to them; only advance commits;
    truncate rolls back, and the next write overwrites the stale entries."""
    c = KVCache(L, H, D, T_MAX)
    assert c.length == 0 and c.k.shape == (L, 1, H, T_MAX, D)
    for layer in range(L):
        k, v = c.write(layer, *_kv(3, 1.0 + layer))
        assert k.shape == v.shape == (1, H, 3, D)
        assert torch.all(k == 1.0 + layer) and torch.all(v == -(1.0 + layer))
    assert c.length == 0  # writing alone commits nothing
    c.advance(3)
    assert c.length == 3
    k, v = c.write(0, *_kv(2, 5.0))
    assert k.shape == (1, H, 5, D)
    assert torch.all(k[:, :, :3] == 1.0) and torch.all(k[:, :, 3:] == 5.0) and torch.all(v[:, :, 3:] == -5.0)
    c.advance(2)
    c.truncate(4)
    assert c.length == 4
    k, _ = c.write(0, *_kv(1, 7.0))  # overwrites the stale position 4
    assert k.shape == (1, H, 5, D) and torch.all(k[:, :, 4] == 7.0) and torch.all(k[:, :, 3] == 5.0)
    c.truncate(4)  # truncating to the current length is a no-op
    c.truncate(0)
    assert c.length == 0
    assert c.nbytes == 2 * L * H * T_MAX * D * 4


def test_truncate_beyond_length_raises():
    """truncate may only shrink: a larger (or negative) length is a ValueError and changes nothing."""
    c = KVCache(L, H, D, T_MAX)
    c.advance(3)
    for bad in (4, T_MAX, -1):
        with pytest.raises(ValueError, match="truncate"):
            c.truncate(bad)
        assert c.length == 3


def test_drop_front_keeps_the_newest_entries_in_order():
    """drop_front(n) moves the newest length - n entries (every layer, keys and values) to the front in order and
    shortens the cache; more than its length is a ValueError that changes nothing."""
    c = KVCache(L, H, D, T_MAX)
    for layer in range(L):
        k = torch.arange(6.0).view(1, 1, 6, 1).expand(1, H, 6, D) + 10 * layer
        c.write(layer, k, -k)
    c.advance(6)
    with pytest.raises(ValueError, match="drop"):
        c.drop_front(7)
    assert c.length == 6
    c.drop_front(0)
    assert c.length == 6
    c.drop_front(4)
    assert c.length == 2
    for layer in range(L):
        assert c.k[layer, 0, :, :2, 0].tolist() == [[4.0 + 10 * layer, 5.0 + 10 * layer]] * H
        assert torch.equal(c.v[layer, :, :, :2], -c.k[layer, :, :, :2])
    c.drop_front(2)
    assert c.length == 0


def test_overflow_raises():
    """Writing past max_len raises (naming the capacity) and leaves the committed length unchanged."""
    c = KVCache(L, H, D, T_MAX)
    c.write(0, *_kv(6, 1.0))
    c.advance(6)
    c.write(0, *_kv(2, 2.0))  # exactly full is fine
    with pytest.raises(ValueError, match="overflow"):
        c.write(0, *_kv(3, 3.0))
    assert c.length == 6


def test_model_forward_overflowing_the_cache_raises():
    """A model forward that would run past the cache's capacity fails instead of silently wrapping."""
    m = tiny_model()
    c = KVCache.for_model(m, max_len=10)
    m(torch.zeros(1, 8, dtype=torch.long), cache=c)
    with pytest.raises(ValueError, match="overflow"):
        m(torch.zeros(1, 3, dtype=torch.long), cache=c)


def test_for_model_follows_the_model():
    """for_model sizes the cache from the config (context_limit by default) with the model's dtype, except that
    a bf16 model on CPU keeps an fp32 cache (bf16 attention is several times slower there)."""
    m = tiny_model()
    c = KVCache.for_model(m)
    cfg = m.config
    assert c.k.shape == (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.context_limit, cfg.head_dim)
    assert c.k.dtype == m.dtype and c.max_len == cfg.context_limit
    assert KVCache.for_model(m.to(torch.bfloat16), max_len=16).k.dtype == torch.float32


def _ids(n: int, seed: int, vocab: int = 97) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_rollback_then_extend_equals_fresh_cache():
    """prefix, 5 speculative tokens, truncate back, 3 other tokens == a fresh cache fed prefix + those 3."""
    m = tiny_model()
    prefix, spec, other = _ids(11, 1), _ids(5, 2), _ids(3, 3)
    c = KVCache.for_model(m)
    m(prefix, cache=c)
    m(spec, cache=c)
    c.truncate(prefix.shape[1])
    got, _ = m(other, cache=c)
    fresh = KVCache.for_model(m)
    m(prefix, cache=fresh)
    want, _ = m(other, cache=fresh)
    assert torch.equal(got, want)
    assert c.length == fresh.length == 14
    torch.testing.assert_close(got, m(torch.cat([prefix, other], 1))[0][:, -3:], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_repeated_rollback_cycles_stay_exact():
    """Many extend / partial-truncate / re-extend cycles (as in speculative rounds, incl. single-token steps):
    each step's logits equal a fresh cache's for the same committed tokens + new ones."""
    m = tiny_model()
    rng = random.Random(0)
    committed = _ids(6, 4)[0].tolist()
    c = KVCache.for_model(m)
    m(torch.tensor([committed]), cache=c)
    for step in range(12):
        n = rng.randrange(1, 6)
        new = [rng.randrange(97) for _ in range(n)]
        got, _ = m(torch.tensor([new]), cache=c)
        fresh = KVCache.for_model(m)
        m(torch.tensor([committed]), cache=fresh)
        want, _ = m(torch.tensor([new]), cache=fresh)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=f"step {step}")
        keep = rng.randrange(0, n + 1)  # accept a prefix of the new tokens
        c.truncate(len(committed) + keep)
        committed += new[:keep]
        assert c.length == len(committed)


class _CheckedDrafter(ModelDrafter):
    """A ModelDrafter that checks, every round, that its cached proposals equal a from-scratch (no-cache)
    greedy continuation and that its cache holds exactly the committed prefix after accept."""

    def __init__(self, model):
        super().__init__(model)
        self.rounds: list[tuple[int, int]] = []  # (drafted, accepted)
        self._last: dict[int, int] = {}

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = super().propose(requests)
        for r, d in zip(requests, drafts):
            assert d.tokens == self._fresh_greedy(r.tokens, len(d.tokens)), "draft cache is stale"
            self._last[r.seq_id] = (len(r.tokens), len(d.tokens))
        return drafts

    def accept(self, result: Verified) -> None:
        super().accept(result)
        n, drafted = self._last[result.seq_id]
        self.rounds.append((drafted, result.num_accepted))
        # Committed prefix = n tokens + accepted drafts; the last draft token was never fed to the draft model.
        assert self._caches[result.seq_id].length == n + min(result.num_accepted, drafted - 1)

    @torch.inference_mode()
    def _fresh_greedy(self, tokens: list[int], k: int) -> list[int]:
        seq = list(tokens)
        for _ in range(k):
            logits, _ = self.model(torch.tensor([seq]), num_logits=1)
            seq.append(int(logits[0, -1].argmax()))
        return seq[len(tokens) :]


@pytest.mark.parametrize("draft_kind", ["perturbed-copy", "independent"])
def test_model_drafter_cache_consistent_after_partial_acceptance(draft_kind):
    """Speculative greedy decoding with a separate draft model equals plain greedy; the draft model's cache
    rolls back correctly after partially accepted rounds (checked every round against a no-cache rerun).
    The independent random draft is the light check (it is almost never accepted)."""
    target = tiny_model(seed=0)
    if draft_kind == "perturbed-copy":  # close to the target: full, partial and rejected rounds all occur
        draft = tiny_model(seed=0)
        torch.manual_seed(5)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
    else:
        draft = tiny_model(seed=7, num_hidden_layers=1)
    prompt = _ids(10, 9)[0].tolist()
    params = SamplingParams(max_tokens=40)
    plain = decode(target, prompt, params)
    drafter = _CheckedDrafter(draft)
    spec = decode(target, prompt, params, drafter=drafter, spec=SpecConfig(k=4))
    assert spec.token_ids == plain.token_ids
    assert len(spec.token_ids) == 40
    assert drafter.rounds and not drafter._caches  # finish() freed the sequence's cache
    if draft_kind == "perturbed-copy":
        rounds = drafter.rounds
        assert any(0 < acc < drafted for drafted, acc in rounds), rounds  # partial: cache truncated mid-draft
        assert any(acc == drafted > 1 for drafted, acc in rounds), rounds  # all accepted: nothing to roll back
        assert any(acc == 0 for drafted, acc in rounds), rounds  # all rejected


def test_reserve_grows_and_keeps_the_committed_entries():
    """reserve(n) never shrinks; growing at least doubles the capacity and keeps every committed entry."""
    c = KVCache(L, H, D, 4)
    c.write(0, *_kv(3, 1.0))
    c.advance(3)
    c.reserve(4)
    assert c.max_len == 4
    c.reserve(5)
    assert c.max_len == 8 and c.length == 3
    assert torch.equal(c.k[0, :, :, :3], _kv(3, 1.0)[0]) and torch.equal(c.v[0, :, :, :3], _kv(3, 1.0)[1])
    c.write(0, *_kv(5, 2.0))  # now fits
    c.reserve(100)
    assert c.max_len == 100 and torch.equal(c.k[0, :, :, :3], _kv(3, 1.0)[0])


def test_compact_keeps_the_given_rows_of_the_last_forward_in_order():
    """compact(indices) keeps rows of the last forward's entries (every layer, keys and values), moved to its first
    rows in order; compact(range(m)) is truncate; bad indices are a ValueError that changes nothing."""
    c = KVCache(L, H, D, T_MAX + 4)
    for layer in range(L):
        c.write(layer, *_kv(3, 1.0))
    c.advance(3)
    for layer in range(L):
        k = torch.arange(10.0, 15.0).view(1, 1, 5, 1).expand(1, H, 5, D) + 100 * layer
        c.write(layer, k, -k)
    c.advance(5)
    assert (c.round_start, c.length) == (3, 8)
    for bad in ([0, 5], [2, 1], [1, 1], [-1]):
        with pytest.raises(ValueError, match="compact"):
            c.compact(bad)
        assert c.length == 8
    c.compact([0, 2, 4])
    assert c.length == 6
    for layer in range(L):
        assert c.k[layer, 0, :, :6, 0].tolist() == [[1.0] * 3 + [x + 100 * layer for x in (10.0, 12.0, 14.0)]] * H
        assert torch.equal(c.v[layer, :, :, :6], -c.k[layer, :, :, :6])
    c.compact([0, 1])  # a prefix of the kept rows: the same as truncate(round_start + 2)
    assert c.length == 5 and c.k[0, 0, 0, 3:5, 0].tolist() == [10.0, 12.0]
    c.truncate(2)  # below the last forward's start: nothing of it is left to compact
    assert c.round_start == 2
    c.compact([])
    assert c.length == 2


def test_tree_mask_of_a_chain_is_causal():
    mask = tree_mask(5, [-1, 0, 1], torch.device("cpu"))
    assert torch.equal(mask, causal_mask(5, 4, torch.device("cpu")))
    assert tree_positions(5, [-1, -1, 0, 2], torch.device("cpu")).tolist() == [5, 6, 6, 7, 8]
    tree = tree_mask(2, [-1, -1, 0], torch.device("cpu"))
    assert tree.long().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]]


PARENTS = [-1, -1, 0, 0, 2, 1, 4]  # two branches from the anchor; the deepest path is 0 -> 2 -> 4 -> 6


@torch.inference_mode()
def test_tree_round_then_compact_equals_the_accepted_path_from_scratch():
    """One forward over [anchor, tree nodes] with the tree mask and positions scores each node as a fresh run of
    prefix + its root path does (that one on the native forward where it builds); compacting the cache to the
    anchor and the deepest path leaves what a fresh cache fed prefix + that path holds, and the next forward
    agrees too."""
    m = tiny_model()
    prefix, nodes = _ids(9, 5)[0].tolist(), _ids(len(PARENTS), 6)[0].tolist()
    c = KVCache.for_model(m)
    m(torch.tensor([prefix[:-1]]), cache=c, num_logits=0)
    start = c.length
    got, _ = m(torch.tensor([[prefix[-1], *nodes]]), tree_positions(start, PARENTS, m.device)[None], cache=c,
               attn_mask=tree_mask(start, PARENTS, m.device))

    def root_path(i):
        return [] if i < 0 else root_path(PARENTS[i]) + [i]

    for i in range(-1, len(PARENTS)):
        want, _ = m(torch.tensor([prefix + [nodes[j] for j in root_path(i)]]))
        torch.testing.assert_close(got[0, i + 1], want[0, -1], atol=1e-5, rtol=0, msg=f"node {i}")
    path = root_path(6)
    c.compact([0] + [j + 1 for j in path])
    fresh = KVCache.for_model(m)
    m(torch.tensor([prefix + [nodes[j] for j in path]]), cache=fresh, num_logits=0)
    assert c.length == fresh.length == len(prefix) + len(path)
    torch.testing.assert_close(c.k[:, :, :, : c.length], fresh.k[:, :, :, : c.length], atol=1e-5, rtol=0)
    torch.testing.assert_close(c.v[:, :, :, : c.length], fresh.v[:, :, :, : c.length], atol=1e-5, rtol=0)
    nxt = _ids(3, 7)
    torch.testing.assert_close(m(nxt, cache=c)[0], m(nxt, cache=fresh)[0], atol=1e-5, rtol=0)


@torch.inference_mode()  # as at inference: the kernel serves no gradient
def test_native_kernels_never_apply_a_causal_mask_to_a_tree(monkeypatch):
    """A forward with a tree mask runs the native kernels as a tree, never as a causal forward: decoder.c's whole
    forward with the tree's rows (explicit positions and the mask), or, on the per-layer path, the attention kernel's
    tree form; a causal forward on the per-layer path (explicit positions) calls the causal kernel."""
    from verispec.model import layers

    calls = []
    real = layers.native.attention
    monkeypatch.setattr(layers.native, "attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    m = tiny_model()
    c = KVCache.for_model(m)
    m(_ids(6, 8), cache=c, num_logits=0)
    fused_calls = []
    if m.fused is not None:
        real_fused = m.fused.forward
        def spy(*a, **kw):
            fused_calls.append(a[4] if len(a) > 4 else kw.get("tree"))
            return real_fused(*a, **kw)

        monkeypatch.setattr(m.fused, "forward", spy)
    parents = [-1, -1, 0]
    m(_ids(4, 9), tree_positions(6, parents, m.device)[None], cache=c, attn_mask=tree_mask(6, parents, m.device))
    native_forward = m.fused is not None and m.fused.usable()
    if native_forward:  # decoder.c, as a tree: positions [4], the rows each one sees, their counts
        assert len(fused_calls) == 1 and fused_calls[0] is not None and fused_calls[0][0].tolist() == [6, 7, 7, 8]
        assert calls == []
    fused_calls.clear()
    calls.clear()
    m(_ids(2, 11), cache=c, attn_mask=tree_mask(10, [-1], m.device))  # a mask without positions: the per-layer path
    assert fused_calls == []
    if layers.native.available():
        assert calls and all(not kw["causal"] and kw["tree"] is not None for kw in calls)
    calls.clear()
    m(_ids(1, 12), cache=c)
    assert fused_calls == ([None] if native_forward else [])
    m(_ids(3, 10), torch.arange(13, 16)[None], cache=c)  # explicit positions: the per-layer path
    if layers.native.available():
        assert calls and all(kw["causal"] and kw.get("tree") is None for kw in calls)
