"""Sequential Temperature Scaling (STS) of a block drafter's confidence head (`verispec calibrate`).

The confidence head gives c_j ~ P(x_j accepted | x_1..x_{j-1} accepted); the scheduler uses the prefix survival
a_j = prod_{i<=j} c_i. STS fits one temperature per position, left to right: T_j minimises the expected
calibration error of a_j (with T_1..T_{j-1} already fixed) against the observed survival labels
1[first j drafts accepted], by a 1-D grid search. Order-preserving, so it changes calibration, not ranking.
Labels come from real verification rounds (greedy here, the regime the benchmarks run in). The result is written
next to the drafter as calibration.json {"sts_temperatures": [...]}, which the drafter loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters.base import Drafter, DraftRequest, Verified
from verispec.drafters.block import BlockDrafter

GRID = np.exp(np.linspace(np.log(0.2), np.log(5.0), 61))
BINS = 20


def ece(pred: np.ndarray, label: np.ndarray, bins: int = BINS) -> float:
    """Expected calibration error with equal-width bins."""
    if len(pred) == 0:
        return float("nan")
    idx = np.minimum((pred * bins).astype(int), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += sel.mean() * abs(pred[sel].mean() - label[sel].mean())
    return float(total)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


@dataclass(frozen=True)
class STSResult:
    temperatures: list[float]
    ece_before: list[float]  # per position, of the cumulative survival a_j, T = 1
    ece_after: list[float]
    rounds: list[int]  # observations per position

    def to_json(self) -> dict:
        return {"sts_temperatures": self.temperatures, "ece_before": self.ece_before, "ece_after": self.ece_after,
                "rounds_per_position": self.rounds,
                "mean_ece_before": float(np.nanmean(self.ece_before)), "mean_ece_after": float(np.nanmean(self.ece_after))}


def fit_sts(logits: np.ndarray, accepted: np.ndarray, grid: np.ndarray = GRID) -> STSResult:
    """logits [N, K] raw confidence logits (NaN where position j was not drafted); accepted [N] accepted counts."""
    n, k = logits.shape
    temps: list[float] = []
    before, after, counts = [], [], []
    prefix_raw = np.ones(n)
    prefix_cal = np.ones(n)
    for j in range(k):
        rows = ~np.isnan(logits[:, j])
        label = (accepted > j).astype(float)
        raw = prefix_raw * _sigmoid(np.nan_to_num(logits[:, j]))
        counts.append(int(rows.sum()))
        before.append(ece(raw[rows], label[rows]))
        scores = [ece((prefix_cal * _sigmoid(np.nan_to_num(logits[:, j]) / t))[rows], label[rows]) for t in grid]
        best = float(grid[int(np.nanargmin(scores))]) if rows.any() else 1.0
        temps.append(best)
        prefix_raw = raw
        prefix_cal = prefix_cal * _sigmoid(np.nan_to_num(logits[:, j]) / best)
        after.append(ece(prefix_cal[rows], label[rows]))
    return STSResult(temps, before, after, counts)


class _Recorder(Drafter):
    """Passes through to a block drafter (uncalibrated) and records each round's confidence logits and verdict."""

    def __init__(self, inner: BlockDrafter) -> None:
        self.inner = inner
        self.capabilities = inner.capabilities
        self.rows: list[tuple[list[float], int]] = []
        self._pending: dict[int, list[float]] = {}

    def start(self, seq_id, prompt):
        self.inner.start(seq_id, prompt)

    def observe(self, seq_id, start, hidden):
        self.inner.observe(seq_id, start, hidden)

    def finish(self, seq_id):
        self.inner.finish(seq_id)

    def propose(self, requests: list[DraftRequest]):
        drafts = self.inner.propose(requests)
        for r, d in zip(requests, drafts):
            c = d.confidence.double().clamp(1e-9, 1 - 1e-9) if d.confidence is not None else torch.zeros(0)
            self._pending[r.seq_id] = torch.log(c / (1 - c)).tolist()
        return drafts

    def accept(self, result: Verified) -> None:
        logits = self._pending.pop(result.seq_id, None)
        if logits:
            self.rows.append((logits, result.num_accepted))
        self.inner.accept(result)


def collect(drafter: BlockDrafter, prompts: list[list[int]], max_tokens: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Greedy speculative decoding of every prompt at k = block size; returns (logits [N, K], accepted [N])."""
    saved, drafter.temperatures = drafter.temperatures, []
    rec = _Recorder(drafter)
    k = drafter.model.config.block_size
    try:
        for i, prompt in enumerate(prompts):
            decode(drafter.target, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), drafter=rec,
                   spec=SpecConfig(k=k), seq_id=i)
    finally:
        drafter.temperatures = saved
    logits = np.full((len(rec.rows), k), np.nan)
    for i, (row, _) in enumerate(rec.rows):
        logits[i, : len(row)] = row
    return logits, np.array([a for _, a in rec.rows])


def calibrate(drafter: BlockDrafter, prompts: list[list[int]], out_dir: Path, max_tokens: int = 64) -> STSResult:
    logits, accepted = collect(drafter, prompts, max_tokens)
    result = fit_sts(logits, accepted)
    (out_dir / "calibration.json").write_text(json.dumps(result.to_json(), indent=1) + "\n")
    drafter.temperatures = result.temperatures
    return result
