"""The block drafter's sliding context window (BlockConfig.context_window, `:window=N`): a proposal sees exactly
the latest W..2W positions (the same draft as a fresh drafter given only those), the cache stays in that range
through prefill chunks and accepted rounds, outputs stay exact, and the option loads or fails clearly."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from test_block_drafter import GREEDY, KINDS, PROMPTS, _assert_engine_samples_from_target, make_block

from verispec.config import EngineConfig, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import DraftRequest, build_drafter
from verispec.drafters.base import Drafter
from verispec.drafters.block import BlockDrafter, load_block_drafter, save_block_drafter
from verispec.engine import Engine
from verispec.errors import ConfigError
from verispec.model.block import BlockConfig

LONG = PROMPTS[0] + PROMPTS[1]  # 21 tokens
CPU = dict(dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, 0.2)


class _Rounds(Drafter):
    """Passes through to a block drafter and records, per proposal, the committed tokens, the first visible
    context position and the draft."""

    def __init__(self, inner: BlockDrafter) -> None:
        self.inner, self.seen = inner, []
        self.capabilities = inner.capabilities

    def start(self, seq_id, prompt):
        self.inner.start(seq_id, prompt)

    def observe(self, seq_id, start, hidden):
        self.inner.observe(seq_id, start, hidden)

    def propose(self, requests):
        drafts = self.inner.propose(requests)
        for r, d in zip(requests, drafts):
            self.seen.append((list(r.tokens), self.inner._ctx_start[r.seq_id], d))
        return drafts

    def accept(self, result):
        self.inner.accept(result)

    def finish(self, seq_id):
        self.inner.finish(seq_id)


def _check_against_fresh(model, target, seen, w: int) -> None:
    """Each recorded proposal saw W..2W positions and drafted what a windowless drafter drafts when it is given
    only those positions' rows (and tokens) from position 0: RoPE makes the shift invisible, so any wrong
    position, missing row or extra row shows."""
    starts = set()
    for committed, start, draft in seen:
        anchor = len(committed) - 1
        assert min(w, anchor) <= anchor - start <= 2 * w, (anchor, start)
        starts.add(start)
        fresh = BlockDrafter(model, target)
        visible = committed[start:]
        fresh.start(0, visible)
        if anchor:
            with torch.inference_mode():
                _, hidden = target(torch.tensor([committed[:-1]]), hidden_layers=(1,))
            fresh.observe(0, 0, {1: hidden[1][0, start:]})
        ref = fresh.propose([DraftRequest(0, visible, len(draft.tokens), SamplingParams(), None)])[0]
        assert draft.tokens == ref.tokens
        torch.testing.assert_close(draft.confidence, ref.confidence, rtol=1e-4, atol=1e-5)
    assert len(starts) > 2  # the window slid several times


@pytest.mark.parametrize("prepared", [False, True])
def test_window_proposal_equals_a_fresh_drafter_on_the_visible_positions(prepared, target):
    """A W = 3 drafter over a 21-token prompt and 24 generated tokens (decode: one-request proposals, through the
    native layers where they build when `prepared`): exact output, and every draft as _check_against_fresh says."""
    model = make_block(target, **KINDS["dspark"])
    if prepared:
        model = model.prepare_inference()
    rec = _Rounds(BlockDrafter(model, target, context_window=3))
    out = decode(target, LONG, GREEDY, drafter=rec, spec=SpecConfig(k=4))
    assert out.token_ids == decode(target, LONG, GREEDY).token_ids
    _check_against_fresh(model, target, rec.seen, 3)


def test_window_bookkeeping_through_prefill_chunks(target):
    """Prefill chunks longer and shorter than W keep the latest W rows; a chunk that does not continue the
    context is refused; window 0 keeps everything."""
    model = make_block(target, **KINDS["dspark"])
    with torch.inference_mode():
        _, hidden = target(torch.tensor([LONG]), hidden_layers=(1,))
    rows = hidden[1][0]
    for chunks in ([(0, 20)], [(0, 2), (2, 9), (9, 20)], [(0, 10), (10, 12), (12, 20)]):
        d = BlockDrafter(model, target, context_window=4)
        d.start(0, LONG)
        for a, b in chunks:
            d.observe(0, a, {1: rows[a:b]})
            assert d.context_length(0) == b
        d._flush(0)  # observed rows wait for the next proposal; project them now to look at the cache
        assert d.context_length(0) == 20 and d._context(0).length == 4 and d._ctx_start[0] == 16
        whole = BlockDrafter(model, target)
        whole.start(0, LONG)
        whole.observe(0, 0, {1: rows[:20]})
        whole._flush(0)
        torch.testing.assert_close(d._context(0).k[:, :, :, :4], whole._context(0).k[:, :, :, 16:20], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d._context(0).v[:, :, :, :4], whole._context(0).v[:, :, :, 16:20], rtol=1e-5, atol=1e-6)
        assert whole._context(0).length == 20
        with pytest.raises(ValueError, match="new rows start at 19"):
            d.observe(0, 19, {1: rows[19:20]})


@pytest.mark.parametrize("kind", ["parallel", "dspark"])
def test_window_through_the_engine(kind, target):
    """A1 with W = 2 through the engine (chunked prefill, batched and one-request proposals), and every draft as
    _check_against_fresh says."""
    model = make_block(target, **KINDS[kind])
    rec = _Rounds(BlockDrafter(model, target, context_window=2))
    engine = Engine(target, None, EngineConfig(k=4, drafter="b", prefill_chunk=5), drafters={"b": rec})
    prompts = [LONG, *PROMPTS]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    results = engine.run_until_done()
    for i, p in zip(ids, prompts):
        assert results[i].token_ids == decode(target, p, GREEDY).token_ids
    _check_against_fresh(model, target, rec.seen, 2)


def test_window_samples_from_target():
    """A5 through the engine with W = 2 (the stat target's prompts are longer than two positions)."""
    stat_target = tiny_model(0, 0.25, vocab_size=12, max_position_embeddings=16, num_hidden_layers=2)
    model = make_block(stat_target, block_size=2, std=0.5, **KINDS["dspark"])
    _assert_engine_samples_from_target(BlockDrafter(model, stat_target, context_window=2), stat_target)


def test_window_option_loads_or_fails_clearly(tmp_path, target):
    """The checkpoint's context_window is the default; `:window=N` overrides it (0: everything), with or without
    `:full-vocab`; a malformed or negative window is an error naming it."""
    d = tmp_path / "d"
    model = make_block(target, head="markov", confidence=True)
    save_block_drafter(model, d)
    meta = json.loads((d / "config.json").read_text())
    assert meta["block"]["context_window"] == 0
    meta["block"]["context_window"] = 7
    (d / "config.json").write_text(json.dumps(meta))
    (d / "draft_vocab.json").write_text(json.dumps({"token_ids": [1, 7, 50]}))
    assert load_block_drafter(d, target).window == 7
    assert build_drafter(f"dspark:{d}", target=target, **CPU).window == 7
    assert build_drafter(f"dspark:{d}:window=0", target=target, **CPU).window == 0
    both = build_drafter(f"block:{d}:window=5:full-vocab", target=target, **CPU)
    assert both.window == 5 and both.draft_vocab is None
    assert build_drafter(f"lookup:dspark:{d}:full-vocab:window=3", target=target, **CPU).inner.window == 3
    with pytest.raises(ConfigError, match="window=N"):
        build_drafter(f"dspark:{d}:window=-1", target=target, **CPU)
    with pytest.raises(ConfigError, match="context_window"):
        BlockConfig(target_layers=(1,), context_window=-1)
    with pytest.raises(ValueError, match="context_window"):
        BlockDrafter(model, target, context_window=-2)


def test_warm_start_ignores_the_context_window(tmp_path, target):
    """The window is how inference uses the weights: a run with another window warm-starts from them."""
    from dataclasses import replace

    from verispec.model.block import BlockDraftModel
    from verispec.train.block import warm_start

    model = make_block(target, head="markov", confidence=True)
    save_block_drafter(model, tmp_path / "d")
    other = BlockDraftModel(target.config, replace(model.config, context_window=128))
    warm_start(other, tmp_path / "d", target.config)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b)


@pytest.mark.parametrize("prepared", [False, True])
def test_window_cache_is_sized_by_the_window_and_grows_for_pending_rows(prepared, target):
    """A windowed drafter's context cache starts at 2W + 2 blocks, not the whole context; behind prompt lookup
    (which drafts a repetitive prompt's continuation itself while the block drafter only hears the accepted rows)
    pending rows pile up past that and the cache grows for them; every block proposal is still exactly what a
    fresh windowless drafter drafts on the visible positions, and the output is plain decoding's."""
    from verispec.drafters.lookup import LookupFirstDrafter

    model = make_block(target, **KINDS["dspark"])
    if prepared:
        model = model.prepare_inference()
    inner = BlockDrafter(model, target, context_window=2)
    rec = _Rounds(inner)
    prompt = PROMPTS[0] * 3  # repeats itself: prompt lookup drafts most rounds
    inner.start(7, prompt)
    assert inner._context(7).max_len == 2 * 2 + 2 * model.config.block_size < target.config.context_limit
    inner.finish(7)
    first = 2 * 2 + 2 * model.config.block_size
    capacity = []
    original = inner.propose

    def propose(requests):
        drafts = original(requests)
        capacity.append(inner._ctx[requests[0].seq_id].max_len)
        return drafts

    inner.propose = propose
    out = decode(target, prompt, GREEDY, drafter=LookupFirstDrafter(rec), spec=SpecConfig(k=4))
    assert out.token_ids == decode(target, prompt, GREEDY).token_ids
    assert capacity[0] == first and max(capacity) > first  # grew for rows pending from lookup rounds
    _check_against_fresh(model, target, rec.seen, 2)
