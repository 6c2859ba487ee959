"""Block-drafter losses on canned logits: the AUF mask and each loss's value by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from verispec.train.losses import auf_mask, block_loss, decay_weights

V = 5


def canned(preds: list[list[int]], big: float = 10.0) -> torch.Tensor:
    """Logits [N, B, V] whose argmax at each position is preds[n][b]."""
    z = torch.zeros(len(preds), len(preds[0]), V)
    for n, row in enumerate(preds):
        for b, tok in enumerate(row):
            z[n, b, tok] = big
    return z


def test_auf_mask_keeps_through_first_failure():
    labels = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    preds = [[1, 2, 0, 4],  # first failure at 2: keep 0..2
             [0, 2, 3, 4],  # fails at once: keep 0 only
             [1, 2, 3, 4]]  # never fails: keep all
    mask = torch.ones(3, 4, dtype=torch.bool)
    got = auf_mask(canned(preds), labels, mask)
    assert got.tolist() == [[True, True, True, False], [True, False, False, False], [True] * 4]


def test_auf_mask_respects_the_sequence_mask():
    labels = torch.tensor([[1, 2, 3, 4]])
    mask = torch.tensor([[True, True, False, False]])  # block runs past the sequence end
    got = auf_mask(canned([[1, 2, 0, 0]]), labels, mask)
    assert got.tolist() == [[True, True, False, False]]  # errors outside the mask neither count nor get kept


def test_auf_mask_is_detached_from_gradients():
    z = canned([[1, 0]]).requires_grad_()
    loss = block_loss("auf", z, torch.tensor([[1, 2]]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()


def _ce(z, y):
    return F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


def test_ce_decay_and_auf_values():
    torch.manual_seed(0)
    z = torch.randn(2, 4, V)
    y = torch.randint(0, V, (2, 4))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    ce = _ce(z, y)
    w = torch.exp(-torch.arange(4) / 4.0)
    assert torch.allclose(block_loss("ce", z, y, mask), ce[mask].mean())
    expected = (ce * w * mask).sum() / (w * mask).sum()
    assert torch.allclose(block_loss("ce+decay", z, y, mask), expected)
    keep = auf_mask(z, y, mask)
    assert torch.allclose(block_loss("auf", z, y, mask), ce[keep].mean())
    assert torch.allclose(block_loss("auf+decay", z, y, mask), (ce * w * keep).sum() / (w * keep).sum())
    assert torch.allclose(decay_weights(3, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_auf_equals_ce_when_the_drafter_is_always_right():
    y = torch.tensor([[1, 2, 3]])
    z = canned([[1, 2, 3]], big=3.0)
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert torch.allclose(block_loss("auf", z, y, mask), block_loss("ce", z, y, mask))


def test_dspark_loss_terms():
    torch.manual_seed(1)
    z = torch.randn(1, 3, V)
    y = torch.randint(0, V, (1, 3))
    p = torch.randn(1, 3, V).softmax(-1)
    c = torch.tensor([[0.9, 0.5, 0.2]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    w = torch.exp(-torch.arange(3) / 4.0)
    q = z.softmax(-1)
    l1 = (q - p).abs().sum(-1)
    label = 1 - 0.5 * l1
    bce = -(label * c.log() + (1 - label) * (1 - c).log())
    wm = lambda v: (v * w).sum() / w.sum()  # noqa: E731
    expected = 0.1 * wm(_ce(z, y)) + 0.9 * wm(l1) + 1.0 * wm(bce)
    assert torch.allclose(block_loss("dspark", z, y, mask, target_probs=p, confidence=c), expected, atol=1e-6)
    # a drafter equal to the target has zero L1 and confidence label 1
    same = block_loss("dspark", p.log(), y, mask, target_probs=p, confidence=torch.full((1, 3), 1 - 1e-6))
    assert same < 0.1 * wm(_ce(p.log(), y)) + 1e-4


def test_bad_arguments():
    z, y, m = torch.zeros(1, 2, V), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown loss"):
        block_loss("mse", z, y, m)
    with pytest.raises(ValueError, match="target_probs"):
        block_loss("dspark", z, y, m)
