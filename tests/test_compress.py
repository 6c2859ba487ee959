"""Compressed KV caches at the unit level (cache/kv.py's append / evict / select, cache/compress.py's compressors and
CompressedView): rows move as documented, positions survive eviction, a forward over an evicted cache equals a
forward over the same rows at their explicit positions (torch and native paths), each compressor keeps the rows it
says it keeps, KIVI stays within half a quantization step, and bad configurations fail with ConfigError."""

from __future__ import annotations

import pytest
import torch
from conftest import no_native_reason, tiny_model

from verispec.cache import KVCache
from verispec.cache.compress import (
    KIVI, CompressedView, Composed, Retrieval, SnapKV, StreamingLLM, make_compressor, top_positions,
)
from verispec.errors import ConfigError
from verispec.kernels import native

needs_native = pytest.mark.skipif(not native.available(), reason=no_native_reason())

L, H, D = 2, 2, 4  # layers, KV heads, head dim of the hand-made caches


def tagged(n: int, capacity: int | None = None, start: int = 0) -> KVCache:
    """A cache of n rows whose every k element of row i is tag(layer, head, start + i) and v is its negative: the
    position, layer and head of any row can be read back after rows move."""
    cache = KVCache(L, H, D, capacity or n + 8)
    cache.append(*tag_rows(start, n))
    return cache


def tag_rows(start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(start, start + n, dtype=torch.float32)
    tag = pos[None, None, None, :, None] + 1000 * torch.arange(L)[:, None, None, None, None] \
        + 100 * torch.arange(H)[None, None, :, None, None]
    k = tag.expand(L, 1, H, n, D).clone()
    return k, -k


def positions_of(cache: KVCache, layer: int = 0, head: int = 0) -> list[int]:
    """The positions the committed rows of one layer and head hold (from their tags)."""
    tags = cache.k[layer, 0, head, : cache.length, 0] - 1000 * layer - 100 * head
    assert torch.equal(cache.v[layer, 0, head, : cache.length, 0], -cache.k[layer, 0, head, : cache.length, 0])
    return [int(t) for t in tags]


# ---- KVCache: append / evict / select -------------------------------------------------------------------------

def test_append_commits_rows_after_the_committed_ones():
    cache = tagged(5, capacity=9)
    assert (cache.length, cache.round_start, cache.next_position) == (5, 0, 5)
    cache.append(*tag_rows(5, 3))
    assert positions_of(cache, 1, 1) == list(range(8)) and (cache.length, cache.round_start) == (8, 5)
    with pytest.raises(ValueError, match="overflow"):
        cache.append(*tag_rows(8, 2))
    assert cache.length == 8  # a refused append changes nothing


def test_evict_moves_the_later_rows_up_and_keeps_positions():
    cache = tagged(12)
    cache.evict(3, 4)
    for layer in range(L):
        for head in range(H):
            assert positions_of(cache, layer, head) == [0, 1, 2, 7, 8, 9, 10, 11]
    assert (cache.length, cache.position_offset, cache.next_position) == (8, 4, 12)
    cache.evict(8, 0)  # nothing, at the end
    cache.evict(0, 2)
    assert positions_of(cache) == [2, 7, 8, 9, 10, 11]
    assert (cache.length, cache.position_offset, cache.next_position) == (6, 6, 12)
    cache.append(*tag_rows(12, 2))  # new rows go after the kept ones, at their own positions
    assert positions_of(cache) == [2, 7, 8, 9, 10, 11, 12, 13] and cache.next_position == 14


@pytest.mark.parametrize("start,n", [(-1, 2), (2, -1), (10, 3), (0, 13), (12, 1)])
def test_evict_refuses_rows_it_does_not_hold(start, n):
    cache = tagged(12)
    with pytest.raises(ValueError):
        cache.evict(start, n)
    assert (cache.length, cache.position_offset) == (12, 0) and positions_of(cache) == list(range(12))


def test_select_keeps_different_rows_per_head():
    cache = tagged(10)
    cache.evict(1, 2)  # rows hold positions 0, 3, 4, ..., 9; position_offset 2
    # Keep rows 0..1 (positions 0, 3), and from row 2 on, per layer and head, 3 of the rows 2..7 (positions 4..9).
    index = torch.tensor([[[2, 3, 7], [4, 5, 6]], [[2, 6, 7], [3, 4, 5]]])[:, None]  # [L, B, Hkv, 3]
    cache.select(2, index)
    assert positions_of(cache, 0, 0) == [0, 3, 4, 5, 9]
    assert positions_of(cache, 0, 1) == [0, 3, 6, 7, 8]
    assert positions_of(cache, 1, 0) == [0, 3, 4, 8, 9]
    assert positions_of(cache, 1, 1) == [0, 3, 5, 6, 7]
    assert (cache.length, cache.position_offset, cache.next_position) == (5, 5, 10)


def test_select_refuses_bad_shapes():
    cache = tagged(10)
    with pytest.raises(ValueError):
        cache.select(0, torch.zeros(L, 1, H + 1, 2, dtype=torch.long))  # wrong head count
    with pytest.raises(ValueError):
        cache.select(8, torch.tensor([8, 9, 9]).expand(L, 1, H, 3))  # 3 rows from row 8 of 10
    assert (cache.length, cache.position_offset) == (10, 0) and positions_of(cache) == list(range(10))


@pytest.mark.parametrize("index", [[1, 5], [4, 10]], ids=["before-start", "past-length"])
def test_select_refuses_rows_outside_its_range(index):
    """select's documented domain is rows [start, length): an index outside it must be refused (ValueError, as
    evict, truncate and compact refuse theirs), not gathered (a row before `start` would be kept twice) or left to
    torch.gather's RuntimeError."""
    cache = tagged(10)
    with pytest.raises(ValueError):
        cache.select(3, torch.tensor(index).expand(L, 1, H, 2))


# ---- a forward over an evicted cache --------------------------------------------------------------------------

def _evicted_pair(model, tokens: list[int]):
    """Two caches holding the same rows of a prefill of `tokens`: one evicted (rows 4..13 dropped, then per head
    selected rows), the other a plain copy of those rows with no position offset."""
    cache = KVCache.for_model(model, max_len=64)
    with torch.no_grad():
        model(torch.tensor([tokens]), positions=torch.arange(len(tokens))[None], cache=cache, num_logits=0)
    cache.evict(4, 10)
    hkv = model.config.num_key_value_heads
    layers = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    rows = cache.length - 4
    index = torch.stack([torch.randperm(rows, generator=g)[:12].sort().values + 4
                         for _ in range(layers * hkv)]).view(layers, 1, hkv, 12)
    cache.select(4, index)
    copy = KVCache.for_model(model, max_len=64)
    copy.append(cache.k[:, :, :, : cache.length].clone(), cache.v[:, :, :, : cache.length].clone())
    assert cache.next_position == len(tokens) and copy.next_position == cache.length < len(tokens)
    return cache, copy


TOKENS = [int(t) for t in torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(3))]
NEW = [7, 21, 64, 5, 33]


def test_forward_over_an_evicted_cache_puts_tokens_at_their_positions():
    """The torch path: default positions over an evicted cache (next_position on) equal explicit positions over
    a copy of its rows; the copy at its own default positions (row count on) differs, so the check can fail."""
    model = tiny_model(2, 0.5)
    model.fused = None  # the per-layer torch path, whatever the grad mode
    with torch.no_grad():
        assert model.forward_path == "torch"
        cache, copy = _evicted_pair(model, TOKENS)
        rows = copy.length
        got, _ = model(torch.tensor([NEW]), cache=cache)
        want, _ = model(torch.tensor([NEW]), positions=torch.arange(40, 45)[None], cache=copy)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert torch.equal(cache.k[:, :, :, : cache.length], copy.k[:, :, :, : copy.length])
        assert cache.next_position == 45 and cache.length == copy.length == rows + 5
        copy.truncate(rows)
        wrong, _ = model(torch.tensor([NEW]), cache=copy)  # at positions rows.. instead of 40..
    assert (wrong - want).abs().max() > 1e-2


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_forward_over_an_evicted_cache_equals_torch(dtype):
    """A packed CPU model under inference_mode runs decoder.c, which takes each sequence's first position from
    next_position: equal to the torch path at explicit positions, to rounding."""
    model = tiny_model(2, 0.5).to(dtype).pack_weights()
    calls = []
    fused_forward = model.fused.forward
    model.fused.forward = lambda *a, **kw: calls.append(1) or fused_forward(*a, **kw)
    with torch.inference_mode():
        cache, copy = _evicted_pair(model, TOKENS)
        assert model.forward_path == "native"
        got, _ = model(torch.tensor([NEW]), cache=cache)
        assert calls, "the native forward did not run"
        want, _ = model(torch.tensor([NEW]), positions=torch.arange(40, 45)[None], cache=copy)
    assert len(calls) == 1  # explicit positions take the torch path
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(cache.k[:, :, :, : cache.length], copy.k[:, :, :, : copy.length], rtol=tol, atol=tol)


# ---- compressors through CompressedView.sync ------------------------------------------------------------------

def _feed(full: KVCache, view: CompressedView, chunks: list[int], queries=None, check=None) -> None:
    """Commit rows to `full` chunk by chunk (tagged by position), syncing the view after each."""
    for n in chunks:
        full.append(*tag_rows(full.length, n))
        view.sync(queries)
        assert view.synced == full.length == view.cache.next_position
        if check is not None:
            check()


@pytest.mark.parametrize("slack", [0, 3])
def test_streaming_keeps_sinks_and_the_latest_rows(slack):
    comp = StreamingLLM(sinks=3, recent=9, slack=slack)
    full = KVCache(L, H, D, 200)
    view = CompressedView(full, comp, headroom=4)  # chunks larger than the headroom are synced in pieces

    def check() -> None:
        n, rows = full.length, view.cache.length
        assert rows <= comp.budget
        want = list(range(min(3, n))) + list(range(max(3, n - rows + 3), n))
        for layer in range(L):
            for head in range(H):
                assert positions_of(view.cache, layer, head) == want
        assert view.cache.position_offset == n - rows
        if n > comp.budget:
            assert rows >= comp.budget - slack

    _feed(full, view, [5, 5, 1, 10, 2, 30, 1, 1], check=check)
    assert view.cache.position_offset > 0
    assert view.cache.length == 12 or (slack and view.cache.length >= 9)


def steering(n: int, w: int, sets: list[dict[tuple[int, int], list[int]]], group: int = 2):
    """Keys for n positions and one QueryFn per set, under which the window's w queries of layer l and KV head h
    attend to the positions set[(l, h)] and nowhere else noticeably: set s marks its positions with a one in channel
    s * H + h of their keys, and its queries look at that channel only (logit 20 there, 0 elsewhere). Values carry
    the position tags (`v_positions`)."""
    k = torch.zeros(L, 1, H, n, D)
    fns = []
    for s, targets in enumerate(sets):
        q = torch.zeros(L, 1, H * group, w, D)
        for (layer, head), pos in targets.items():
            k[layer, 0, head, pos, s * H + head] = 1.0
            q[layer, 0, head * group : (head + 1) * group, :, s * H + head] = 40.0
        fns.append(lambda layer, q=q: q[layer])
    return k, tag_rows(0, n)[1], fns


def v_positions(cache: KVCache, layer: int, head: int, start: int = 0) -> list[int]:
    """The positions of one layer and head's committed rows from `start` on, read from the value tags."""
    return [int(-t) - 1000 * layer - 100 * head for t in cache.v[layer, 0, head, start : cache.length, 0]]


def test_top_positions_picks_what_each_head_attends_to():
    targets = {(0, 0): [1, 5, 9], (0, 1): [0, 2, 14], (1, 0): [3, 4, 11], (1, 1): [6, 12, 13]}
    k, _, (queries,) = steering(20, 4, [targets])
    for layer in range(L):
        got = top_positions(queries(layer), k[layer], 16, 3, 1)
        assert got.tolist() == [[targets[(layer, 0)], targets[(layer, 1)]]]
    # Max-pooling gives a position its neighbours' scores: one attended position keeps its two neighbours too.
    k, _, (queries,) = steering(20, 4, [{(0, 0): [7], (0, 1): [0], (1, 0): [15], (1, 1): [3]}])
    assert top_positions(queries(0), k[0], 16, 3, 3)[0, 0].tolist() == [6, 7, 8]
    assert top_positions(queries(1), k[1], 16, 2, 3)[0, 0].tolist() == [14, 15]  # candidates end at 15


def test_snapkv_keeps_the_attended_positions_per_head_then_the_recent_ones():
    targets = {(0, 0): [1, 5, 9, 20], (0, 1): [0, 2, 14, 21], (1, 0): [3, 4, 11, 17], (1, 1): [6, 12, 13, 19]}
    n, w = 30, 4
    comp = SnapKV(keep=4, recent=6, window=w, pool=1)
    full = KVCache(L, H, D, 100)
    view = CompressedView(full, comp, headroom=8)  # the 30-row prompt is longer: kept whole until it is scored
    k, v, (queries,) = steering(n, w, [targets])
    full.append(k, v)
    assert comp.needs_queries
    view.sync(queries)
    assert not comp.needs_queries and view.cache.length == 10 and view.cache.position_offset == 20
    for (layer, head), want in targets.items():
        assert v_positions(view.cache, layer, head) == want + list(range(24, 30)), (layer, head)
    # Later rows roll through the recent part; the selected positions stay.
    full.append(*tag_rows(30, 5))
    view.sync()
    for (layer, head), want in targets.items():
        assert v_positions(view.cache, layer, head) == want + list(range(29, 35)), (layer, head)
    assert view.cache.next_position == 35 and view.cache.position_offset == 25


def test_snapkv_needs_queries_for_its_first_compression():
    full = tagged(20)
    view = CompressedView(full, SnapKV(keep=4, recent=6, window=4, pool=1), headroom=32)
    with pytest.raises(ValueError, match="queries"):
        view.sync(None)


def test_retrieval_refills_from_the_full_cache_with_the_latest_queries():
    n, w = 36, 4
    comp = Retrieval(keep=3, recent=5, window=w, pool=1)
    first = {(0, 0): [1, 5, 9], (0, 1): [0, 2, 14], (1, 0): [3, 4, 11], (1, 1): [6, 12, 13]}
    later = {(0, 0): [7, 16, 26], (0, 1): [8, 9, 10], (1, 0): [0, 23, 29], (1, 1): [2, 5, 18]}
    k, v, (queries, queries2) = steering(n, w, [first, later])
    full = KVCache(L, H, D, 100)
    view = CompressedView(full, comp, headroom=8)
    full.append(k[:, :, :, :30].clone(), v[:, :, :, :30].clone())
    view.sync(queries)
    assert view.cache.length == 8 and view.cache.position_offset == 22 and view.synced == 30
    for (layer, head), want in first.items():
        assert v_positions(view.cache, layer, head) == want + list(range(25, 30))
    # Six more rows and new queries that attend elsewhere: the view is refilled from all 36 rows of the full
    # cache, positions it had dropped included.
    full.append(k[:, :, :, 30:].clone(), v[:, :, :, 30:].clone())
    view.sync(queries2)
    assert view.cache.length == 8 and view.cache.position_offset == 28 and view.synced == 36
    for (layer, head), want in later.items():
        assert v_positions(view.cache, layer, head) == want + list(range(31, 36))
    # Nothing new in the full cache: no refill, whatever the queries.
    view.sync(queries)
    for (layer, head), want in later.items():
        assert v_positions(view.cache, layer, head) == want + list(range(31, 36))


def test_retrieval_below_its_budget_holds_every_row():
    full = tagged(6)
    view = CompressedView(full, Retrieval(keep=3, recent=5, window=4, pool=1), headroom=4)
    view.sync(lambda layer: torch.zeros(1, H * 2, 4, D))
    assert positions_of(view.cache, 1, 1) == list(range(6)) and view.cache.position_offset == 0


def _random_rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 1, H, n, 16, generator=g) * 3, torch.randn(L, 1, H, n, 16, generator=g)


@pytest.mark.parametrize("bits", [4, 8])
def test_kivi_error_bound_residual_and_bytes(bits):
    group, residual, n = 8, 5, 45
    comp = KIVI(bits=bits, group=group, residual=residual)
    view = KVCache(L, H, 16, 64)
    k, v = _random_rows(n)
    view.append(k.clone(), v.clone())
    comp.compress(view, None)
    q = comp.quantized_rows
    assert q == 40 == (n - residual) // group * group  # whole groups older than the residual rows
    qmax = 2 ** (bits - 1) - 1
    for g0 in range(0, q, group):
        rows = slice(g0, g0 + group)
        k_step = k[:, :, :, rows].abs().amax(dim=3, keepdim=True) / qmax  # per channel over the group
        v_step = v[:, :, :, rows].abs().amax(dim=4, keepdim=True) / qmax  # per token over the channels
        k_err = (view.k[:, :, :, rows] - k[:, :, :, rows]).abs()
        v_err = (view.v[:, :, :, rows] - v[:, :, :, rows]).abs()
        assert bool((k_err <= k_step / 2 * (1 + 1e-5) + 1e-7).all())
        assert bool((v_err <= v_step / 2 * (1 + 1e-5) + 1e-7).all())
        assert k_err.max() > k_step.min() / 8  # it really is quantized (not a copy)
        # Values on the quantization grid: an integer number of steps each.
        steps = view.v[:, :, :, rows] / v_step
        torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-4)
    assert torch.equal(view.k[:, :, :, q:n], k[:, :, :, q:]) and torch.equal(view.v[:, :, :, q:n], v[:, :, :, q:])
    # Bytes: codes at `bits` per element, fp16 scales (keys: per channel per group; values: per token), the
    # residual rows in fp32.
    codes = q * 16 * bits / 8 * 2
    scales = q // group * 16 * 2 + q * 2
    want = L * H * (codes + scales + (n - q) * 16 * 4 * 2)
    assert comp.nbytes(view) == want
    dense = L * H * n * 16 * 4 * 2
    quantized_part = L * H * q * 16 * 4 * 2
    ratio = quantized_part / (want - L * H * (n - q) * 16 * 4 * 2)
    assert (32 / bits) * 0.7 < ratio < 32 / bits
    assert dense / comp.nbytes(view) > {4: 3.5, 8: 2.5}[bits]  # the whole view, 5 fp32 residual rows of 45 included


@pytest.mark.parametrize("evictor", ["streaming", "snapkv"])
@pytest.mark.parametrize("slack", [0, 2])
def test_composed_keeps_the_quantized_row_count_across_evictions(evictor, slack):
    """Evict, then quantize: after every sync rows [0, quantized_rows) are the quantized ones (no row equals a
    row of the full cache) and every later row is an exact copy of a full-cache row; whole groups older than the
    residual rows are quantized."""
    group, residual = 4, 3
    if evictor == "streaming":
        ev: StreamingLLM | SnapKV = StreamingLLM(sinks=5, recent=14, slack=slack)
    else:
        ev = SnapKV(keep=6, recent=13, window=4, pool=3, slack=slack)
    comp = Composed(ev, KIVI(bits=4, group=group, residual=residual))
    assert comp.name == f"{evictor}+kivi" and comp.budget == 19
    full = KVCache(L, H, 16, 300)
    view = CompressedView(full, comp, headroom=16)
    k_all, v_all = _random_rows(300, seed=1)
    g = torch.Generator().manual_seed(2)

    def queries(layer: int) -> torch.Tensor:
        return torch.randn(1, H * 2, 4, 16, generator=g)

    seen_quantized = seen_evicted = 0
    for n in [40, 3, 1, 7, 2, 9, 1, 1, 5, 4, 12, 6, 1, 2, 3]:
        start = full.length
        full.append(k_all[:, :, :, start : start + n].clone(), v_all[:, :, :, start : start + n].clone())
        view.sync(queries)
        cache, q = view.cache, comp.quantizer.quantized_rows
        rows = cache.length
        assert rows <= comp.budget and cache.next_position == full.length
        assert rows - residual - group < q <= rows - residual, (q, rows)
        for layer in range(L):
            for head in range(H):
                ref_k = full.k[layer, 0, head, : full.length]
                ref_v = full.v[layer, 0, head, : full.length]
                for r in range(rows):
                    exact = bool((ref_k == cache.k[layer, 0, head, r]).all(-1).any()) and \
                        bool((ref_v == cache.v[layer, 0, head, r]).all(-1).any())
                    assert exact == (r >= q), (layer, head, r, q, rows)
        seen_quantized = max(seen_quantized, q)
        seen_evicted = cache.position_offset
    assert seen_quantized > 0 and seen_evicted > 0


def test_composed_snapkv_kivi_when_the_prompt_fits_its_budget():
    """The same invariant when the prompt fits the budget, so KIVI quantizes rows before SnapKV's first selection:
    here the queries pick positions 0, 2, 4, 6, 7 and 8; KIVI must wait for that selection (it moves rows), and
    afterwards the quantized rows must still be exactly the first quantized_rows ones."""
    group, residual = 4, 3
    comp = Composed(SnapKV(keep=6, recent=8, window=4, pool=1), KIVI(bits=4, group=group, residual=residual))
    pick = [0, 2, 4, 6, 7, 8]
    k, _, (queries,) = steering(40, 4, [{(layer, head): pick for layer in range(L) for head in range(H)}])
    v = torch.randn(L, 1, H, 40, D, generator=torch.Generator().manual_seed(4))
    full = KVCache(L, H, D, 100)
    view = CompressedView(full, comp, headroom=16)
    for n in [12, 2, 3, 1, 4, 6, 2]:
        start = full.length
        full.append(k[:, :, :, start : start + n].clone(), v[:, :, :, start : start + n].clone())
        view.sync(queries)
        cache, q = view.cache, comp.quantizer.quantized_rows
        if full.length < 17:  # the prompt fits: KIVI waits for SnapKV's selection, which would move its rows
            assert q == 0
        if full.length == 17:  # the first selection: rows hold positions 0 2 4 6 7 8 | 9..16, quantized after it
            assert q == 8 and torch.equal(cache.v[:, :, :, 8], v[:, :, :, 11])
        for layer in range(L):
            for head in range(H):
                ref = full.v[layer, 0, head, : full.length]
                exact = [bool((ref == cache.v[layer, 0, head, r]).all(-1).any()) for r in range(cache.length)]
                assert exact == [r >= q for r in range(cache.length)], (full.length, layer, head, q, exact)
    assert cache.position_offset > 0


# ---- make_compressor ------------------------------------------------------------------------------------------

def test_make_compressor_splits_budgets():
    s = make_compressor("streaming", 16)
    assert isinstance(s, StreamingLLM) and (s.sinks, s.recent, s.budget) == (4, 12, 16)
    assert make_compressor("streaming", 1).budget == 1
    s = make_compressor("snapkv", 24, recent=8, window=4)
    assert isinstance(s, SnapKV) and (s.keep, s.recent, s.window, s.budget) == (16, 8, 4, 24)
    r = make_compressor("retrieval", 16)
    assert isinstance(r, Retrieval) and (r.keep, r.recent, r.budget) == (8, 8, 16)
    kv = make_compressor("kivi", 64, bits="8", group="16")
    assert isinstance(kv, KIVI) and (kv.bits, kv.group, kv.rows) == (8, 16, 64)
    c = make_compressor("streaming+kivi", 20, sinks="2", bits="2", residual="4")
    assert isinstance(c, Composed) and c.evictor.sinks == 2 and (c.quantizer.bits, c.quantizer.residual) == (2, 4)
    assert c.budget == 20 and c.name == "streaming+kivi"


@pytest.mark.parametrize("name,budget,options,match", [
    ("lru", 16, {}, "lru"),
    ("streaming+gptq", 16, {}, "gptq"),
    ("retrieval+kivi", 16, {}, "retrieval"),
    ("streaming", 0, {}, "budget"),
    ("kivi", -3, {}, "budget"),
    ("streaming", 16, {"bits": "4"}, "bits"),
    ("kivi", 16, {"sinks": "2"}, "sinks"),
    ("snapkv", 16, {"pool": "4"}, "pool"),
    ("kivi", 16, {"bits": "3"}, "bits"),
    ("snapkv", 8, {}, "budget of 8 tokens leaves no room"),  # the default window of 16 recent positions
    ("streaming", 16, {"sinks": "16"}, "recent"),
    ("streaming", 16, {"sinks": "x"}, "sinks"),
    ("kivi", 16, {"group": "4.5"}, "group"),
])
def test_make_compressor_refuses_bad_configurations(name, budget, options, match):
    with pytest.raises(ConfigError, match=match):
        make_compressor(name, budget, **options)


# ---- CompressedView -------------------------------------------------------------------------------------------

def test_sync_refuses_a_full_cache_rolled_back_below_what_it_copied():
    full = tagged(20, capacity=40)
    view = CompressedView(full, StreamingLLM(sinks=2, recent=6), headroom=8)
    view.sync()
    full.append(*tag_rows(20, 5))
    full.truncate(22)  # rows it never copied may come and go
    view.sync()
    assert view.synced == 22 and positions_of(view.cache) == [0, 1, 16, 17, 18, 19, 20, 21]
    full.truncate(21)
    with pytest.raises(ValueError, match="rolled back"):
        view.sync()
