"""Prompt lookup first, a learned drafter otherwise (`lookup:SPEC`, e.g. `lookup:dspark:zoo/dspark`).

Learned drafters do not copy: where the output repeats the prompt or itself, an n-gram match drafts better and
almost for free. Each round this drafter proposes the continuation of the longest suffix match of at least
`min_n` tokens, and only without one asks the inner drafter. The choice depends on the committed tokens alone,
never on the tokens it is choosing between, so each draft is still one drafter's exact proposal (a point mass
or the inner drafter's q) and verification stays lossless. The inner drafter hears every round's result, so
its own state (a block drafter's context, a draft model's cache) stays in sync whoever drafted.
"""

from __future__ import annotations

import torch

from verispec.drafters.base import (
    BENCH_SPECS, EMPTY_DRAFT, Draft, Drafter, DraftRequest, Verified, build_drafter, register_drafter,
)
from verispec.drafters.ngram import SuffixLookup
from verispec.errors import ConfigError


class LookupFirstDrafter(Drafter):
    name = "lookup"

    def __init__(self, inner: Drafter, min_n: int = 3, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"lookup sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.inner, self.min_n, self.max_n = inner, min_n, max_n
        self.suffixes = SuffixLookup(max_n, min_n)
        self.capabilities = inner.capabilities  # its own drafts are chains that need nothing
        self.num_lookup = self.num_inner = 0  # rounds drafted by each (diagnostics)

    def start(self, seq_id: int, prompt: list[int]) -> None:
        self.inner.start(seq_id, prompt)

    def observe(self, seq_id: int, start: int, hidden: dict[int, torch.Tensor]) -> None:
        self.inner.observe(seq_id, start, hidden)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [EMPTY_DRAFT] * len(requests)
        rest = []  # requests without a long enough match, for one batched call of the inner drafter
        for i, r in enumerate(requests):
            if r.budget <= 0:
                continue
            found, n = self.suffixes.match(r.seq_id, r.tokens, r.budget)
            if found:
                drafts[i] = Draft.chain(found, kind=f"lookup-n{n}")  # not the inner drafter's acceptance
                self.num_lookup += 1
            else:
                rest.append(i)
        if rest:
            self.num_inner += len(rest)
            for i, d in zip(rest, self.inner.propose([requests[i] for i in rest])):
                drafts[i] = d
        return drafts

    def accept(self, result: Verified) -> None:
        self.inner.accept(result)

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        self.suffixes.rollback(seq_id, num_tokens)
        self.inner.rollback(seq_id, num_tokens)

    def attach_cache(self, seq_id: int, cache) -> None:
        self.inner.attach_cache(seq_id, cache)

    def finish(self, seq_id: int) -> None:
        self.suffixes.finish(seq_id)
        self.inner.finish(seq_id)

    def live_sequences(self) -> set[int]:
        return self.inner.live_sequences() | set(self.suffixes.index)


def _bench_spec(zoo) -> str | None:
    inner = BENCH_SPECS["dspark"](zoo)  # the zoo's DSpark drafter, when it ships one
    return f"lookup:{inner}" if inner else None


@register_drafter("lookup", bench_spec=_bench_spec)
def _build(arg: str | None, *, target: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> LookupFirstDrafter:
    """`lookup:SPEC`: prompt lookup (a suffix match of 3 tokens) first, the drafter SPEC otherwise."""
    if not arg:
        raise ConfigError("the lookup drafter needs an inner drafter: lookup:SPEC, e.g. lookup:dspark:zoo/dspark")
    if arg.partition(":")[0] in ("lookup", "ngram"):
        raise ConfigError(f"lookup:{arg}: the inner drafter must be a learned one (model, block, dspark)")
    return LookupFirstDrafter(build_drafter(arg, target=target, dtype=dtype, device=device))
