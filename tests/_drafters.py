"""Test drafters shared by the exactness and stopping tests."""

from __future__ import annotations

from verispec.drafters import Draft, Drafter, DraftRequest, Verified


class CorruptedOracle(Drafter):
    """Proposes the target's true greedy continuation (computed beforehand by plain greedy decoding), with the
    draft position `pattern[r % len(pattern)]` (0-based; None = no corruption) of drafted round r changed to
    another token. Greedy verification then accepts exactly min(position, budget) tokens in that round, so the
    whole run's rounds and statistics are known in advance. Records (draft, num_accepted, committed) per
    round."""

    name = "corrupted-oracle"

    def __init__(self, prompt_len: int, oracle: list[int], vocab_size: int, pattern=(None,)) -> None:
        self.prompt_len, self.oracle, self.vocab = prompt_len, list(oracle), vocab_size
        self.pattern = list(pattern)
        self.num_proposals = 0
        self._pending: list[int] | None = None
        self.rounds: list[tuple[list[int], int, list[int]]] = []

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            pos = len(r.tokens) - self.prompt_len
            toks = self.oracle[pos : pos + r.budget]
            bad = self.pattern[self.num_proposals % len(self.pattern)]
            if bad is not None and bad < len(toks):
                toks[bad] = (toks[bad] + 1) % self.vocab
            self.num_proposals += 1
            self._pending = toks
            out.append(Draft(tokens=toks))
        return out

    def accept(self, result: Verified) -> None:
        self.rounds.append((self._pending or [], result.num_accepted, list(result.committed)))
        self._pending = None
