"""The feature drafters' one-call native step (model.fused.FusedFeature: input stage, decoder layer, final norm and
draft-vocabulary head in decoder.c) against their torch path: the same drafts, confidences and cache entries to
rounding, over rounds of several requests with accepts and a sliding window; and the input stage's bad arguments
fail before anything is written."""

from __future__ import annotations

import pytest
import torch
from conftest import no_native_reason, tiny_model
from test_feature_drafters import GREEDY, PROMPTS, _accepted_path, make_feature

from verispec.config import SamplingParams, TreeConfig
from verispec.decode import decode
from verispec.drafters import DraftRequest, Verified
from verispec.drafters.feature import FeatureDrafter
from verispec.kernels import native

needs_native = pytest.mark.skipif(not native.available(), reason=no_native_reason())


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, 0.2)


def _pair(target, kind: str, window: int, vocab: bool, tree: TreeConfig = TreeConfig(),
          ) -> tuple[FeatureDrafter, FeatureDrafter]:
    model = make_feature(target, kind, window, packed=True)
    ids = torch.arange(0, target.config.vocab_size, 2) if vocab else None  # a draft vocabulary of half the tokens
    fast = FeatureDrafter(model, target, tree, draft_vocab=ids, context_window=window)
    slow = FeatureDrafter(model, target, tree, draft_vocab=ids, context_window=window)
    slow._native = lambda: None  # the torch path, same weights
    with torch.inference_mode():
        assert fast._native() is not None
    return fast, slow


@needs_native
@pytest.mark.parametrize("kind", ["eagle", "mtp"])
@pytest.mark.parametrize("window,vocab,shape", [(0, False, "chain"), (4, True, "chain"), (0, True, "chain"),
                                                (0, False, "tree"), (4, True, "tree")])
def test_native_step_drafts_what_the_torch_path_drafts(kind, window, vocab, shape, target):
    """Three requests proposed together for six greedy rounds, each round accepting what the target's own
    continuation accepts (a tree: its deepest accepted path): drafts and caches of the two paths agree at every
    round. A tree's levels run natively with each node seeing its ancestors among the earlier levels' entries."""
    fast, slow = _pair(target, kind, window, vocab, TreeConfig("auto", 2, 4, 7) if shape == "tree" else TreeConfig())
    layers = fast.capabilities.hidden_layers
    prompts = PROMPTS[:2] + [list(range(20, 33))]
    truth = [decode(target, p, SamplingParams(max_tokens=60, ignore_eos=True)).token_ids for p in prompts]
    tokens = [list(p) for p in prompts]
    for sid, p in enumerate(prompts):
        _, hidden = target(torch.tensor([p]), hidden_layers=layers)
        for d in (fast, slow):
            d.start(sid, p)
            d.observe(sid, 0, {k: v[0, :-1] for k, v in hidden.items()})
    for _ in range(6):
        requests = [DraftRequest(sid, tokens[sid], (5, 3, 6)[sid], GREEDY, None) for sid in range(3)]
        a, b = fast.propose(requests), slow.propose(requests)
        for sid, (x, y) in enumerate(zip(a, b)):
            assert x.tokens == y.tokens and x.parents == y.parents
            if x.confidence is not None:
                assert torch.allclose(x.confidence, y.confidence, atol=1e-5)
            cx, cy = fast._caches[sid], slow._caches[sid]
            assert (cx.length, cx.position_offset) == (cy.length, cy.position_offset)
            assert torch.allclose(cx.k[:, :, :, : cx.length], cy.k[:, :, :, : cy.length], atol=1e-5)
            assert torch.allclose(cx.v[:, :, :, : cx.length], cy.v[:, :, :, : cy.length], atol=1e-5)
            ref = truth[sid][len(tokens[sid]) - len(prompts[sid]) :]
            n = len(_accepted_path(x, ref))
            committed = ref[: n + 1]
            _, hidden = target(torch.tensor([tokens[sid] + committed[:n]]), hidden_layers=layers)
            rows = {k: v[0, len(tokens[sid]) - 1 :] for k, v in hidden.items()}
            for d in (fast, slow):
                d.accept(Verified(sid, n, committed, rows))
            tokens[sid] += committed


@needs_native
def test_sampled_native_chains_report_the_q_they_draw_from(target):
    """A sampled chain's q rows come from the same logits on both paths (the full-vocabulary distribution, zero
    outside the draft vocabulary), and each drawn token lies where q is positive."""
    fast, slow = _pair(target, "eagle", 0, True)
    prompt = PROMPTS[0]
    _, hidden = target(torch.tensor([prompt]), hidden_layers=fast.capabilities.hidden_layers)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20)
    for d in (fast, slow):
        d.start(0, prompt)
        d.observe(0, 0, {k: v[0, :-1] for k, v in hidden.items()})
    drafts = [d.propose([DraftRequest(0, prompt, 4, params, torch.Generator().manual_seed(3))])[0]
              for d in (fast, slow)]
    assert drafts[0].tokens == drafts[1].tokens
    assert torch.allclose(drafts[0].probs, drafts[1].probs, atol=1e-5)
    q = drafts[0].probs
    assert q.shape == (4, target.config.vocab_size) and torch.all(q[:, 1::2] == 0)
    assert all(q[i, t] > 0 for i, t in enumerate(drafts[0].tokens))


@needs_native
def test_the_input_stage_takes_features_exactly_where_it_exists(target):
    fast, _ = _pair(target, "eagle", 0, False)
    with torch.inference_mode():
        decoder = fast._native().decoder
    d = target.config.hidden_size
    cfg = target.config
    k = torch.zeros(1, cfg.num_key_value_heads, 8, cfg.head_dim)
    rows = [(k, k.clone(), 0, 2)]
    tokens = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="features go with an input stage"):
        decoder.forward(tokens, rows, torch.tensor([1]), (1,))
    with pytest.raises(ValueError, match=r"features must be a contiguous fp32 \[2, "):
        decoder.forward(tokens, rows, torch.tensor([1]), (1,), torch.zeros(3, d))
    with pytest.raises(ValueError, match="token ids must lie"):
        decoder.forward(torch.tensor([3, 10_000]), rows, torch.tensor([1]), (1,), torch.zeros(2, d))
    assert torch.count_nonzero(k) == 0  # nothing written by a refused call
    logits, hidden = decoder.forward(tokens, rows, torch.tensor([1]), (1,), torch.zeros(2, d))
    assert logits.shape == (1, target.config.vocab_size) and hidden[1].shape == (2, d)
    target_decoder = target.fused.decoder
    with pytest.raises(ValueError, match="features go with an input stage"):
        target_decoder.forward(tokens, [(torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, 8, cfg.head_dim),
                                         torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, 8, cfg.head_dim),
                                         0, 2)], torch.tensor([1]), (), torch.zeros(2, d))
