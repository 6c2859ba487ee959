"""Prompt lookup (n-gram) drafting: no weights, a point-mass draft copied from earlier in the sequence."""

from __future__ import annotations

import numpy as np
import torch

from verispec.drafters.base import EMPTY_DRAFT, Draft, Drafter, DraftRequest, register_drafter
from verispec.errors import ConfigError


def lookup(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """Continue the longest suffix n-gram (max_n down to min_n) from an earlier occurrence: the most recent
    one followed by at least k tokens, else the earliest (the longest continuation available).

    Example: tokens = [1, 2, 3, 4, 2, 3], max_n = 2, k = 2: the suffix [2, 3] occurred at index 1, so the
    draft is what followed it, [4, 2].
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        # Windows starting at 0..length-n-1: every earlier occurrence, excluding the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            full = hits[hits <= length - n - k]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"ngram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            if r.budget <= 0:
                out.append(EMPTY_DRAFT)
                continue
            out.append(Draft.chain(lookup(np.asarray(r.tokens, dtype=np.int64), self.max_n, self.min_n, r.budget)))
        return out


@register_drafter("ngram")
def _build(arg: str | None, *, target: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> NgramDrafter:
    """`ngram` or `ngram:MAX_N` or `ngram:MIN_N-MAX_N`."""
    if arg is None:
        return NgramDrafter()
    try:
        lo, _, hi = arg.partition("-")
        return NgramDrafter(max_n=int(hi or lo), min_n=int(lo) if hi else 1)
    except ValueError:
        raise ConfigError(f"bad ngram sizes {arg!r}: use ngram:MAX_N or ngram:MIN_N-MAX_N") from None
