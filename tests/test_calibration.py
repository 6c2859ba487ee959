"""Sequential Temperature Scaling on synthetic, deliberately miscalibrated confidences."""

from __future__ import annotations

import numpy as np
import torch
from conftest import tiny_model
from test_block_drafter import make_block

from verispec.drafters.block import BlockDrafter
from verispec.drafters.calibration import calibrate, ece, fit_sts


def test_ece_of_calibrated_and_miscalibrated_predictions():
    rng = np.random.default_rng(0)
    p = rng.uniform(0, 1, 20000)
    y = (rng.uniform(0, 1, p.shape) < p).astype(float)
    assert ece(p, y) < 0.02
    assert ece(np.clip(p * 1.5, 0, 1), y) > 0.1


def test_sts_recovers_overconfident_temperatures():
    """True per-position acceptance c_j; the head reports logits twice too large (overconfident). STS finds
    T ~ 2 at every position and brings the survival ECE down to about the sampling noise."""
    rng = np.random.default_rng(1)
    n, k = 20000, 4
    true_logit = rng.normal(0.5, 1.2, size=(n, k))
    c = 1 / (1 + np.exp(-true_logit))
    passed = rng.uniform(size=(n, k)) < c
    accepted = np.cumprod(passed, axis=1).sum(axis=1)
    res = fit_sts(2.0 * true_logit, accepted)
    assert all(1.6 < t < 2.5 for t in res.temperatures), res.temperatures
    assert np.mean(res.ece_after) < 0.02 < np.mean(res.ece_before)
    assert all(a <= b + 1e-9 for a, b in zip(res.ece_after, res.ece_before))


def test_calibrate_writes_temperatures_the_drafter_uses(tmp_path):
    target = tiny_model(0, 0.2)
    drafter = BlockDrafter(make_block(target, head="markov", confidence=True), target)
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6], [3, 44, 17, 90, 2]]
    res = calibrate(drafter, prompts, tmp_path, max_tokens=12)
    assert (tmp_path / "calibration.json").is_file()
    assert drafter.temperatures == res.temperatures and len(res.temperatures) == 4
    assert sum(res.rounds) > 0 and torch.is_grad_enabled()
