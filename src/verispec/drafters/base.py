"""The drafter protocol and its registry.

A drafter declares what it needs and yields as data (`capabilities`), is told when a sequence starts and ends,
proposes drafts for a batch of sequences under a per-sequence budget, and hears what verification accepted so it
can sync its own state. The decode loop and the engine never branch on the kind of drafter.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from verispec.cache import KVCache
from verispec.config import SamplingParams, TreeConfig
from verispec.drafters.spec import parse_spec
from verispec.errors import ConfigError


@dataclass(frozen=True)
class DraftRequest:
    seq_id: int
    tokens: list[int]  # committed tokens (prompt + output); the last one is the anchor
    budget: int  # propose at most this many tokens
    params: SamplingParams
    generator: torch.Generator | None  # the request's RNG, for drafters that sample
    # The request's own draft-tree shape (None: the drafter's); honoured where capabilities say tree_requests
    tree: TreeConfig | None = None


@dataclass(frozen=True)
class Draft:
    """A drafter's proposal for one sequence: a tree of k' nodes, each a token with its q row and confidence.

    Nodes are in topological order: node i continues the path to its parent `parents[i]` (< i), and -1 means it
    follows the anchor directly. A chain x_1..x_k is the tree whose parents are -1, 0, ..., k-2, stored as
    `parents=None` (`Draft.chain`). Decode and the engine verify both (round.py); a drafter proposes trees only
    where its capabilities say `trees` (the model drafter with a tree config, drafters.tree).
    """

    tokens: list[int]  # k' <= budget proposed tokens, one per node
    probs: torch.Tensor | None = None  # [k', V] the q each node was drawn from (given its path); None = point mass
    confidence: torch.Tensor | None = None  # [k'] estimated P(node accepted | its parent accepted), if known
    parents: tuple[int, ...] | None = None  # [k'] each node's parent index, -1 = the anchor; None = a chain
    # The draft's class for acceptance estimates learnt online (policies.AcceptanceEstimator), where it gives no
    # confidence: prompt lookup's drafts from a 1-token match are accepted at position 1 a third as often as those
    # from a 3-token match, and one estimate for both verified the first too long and the second too short.
    kind: str | None = None

    def __post_init__(self) -> None:
        k = len(self.tokens)
        if self.probs is not None and self.probs.shape[0] != k:
            raise ValueError(f"draft has {k} tokens but {self.probs.shape[0]} probability rows")
        if self.confidence is not None and self.confidence.shape[0] != k:
            raise ValueError(f"draft has {k} tokens but {self.confidence.shape[0]} confidences")
        if self.parents is not None:
            if len(self.parents) != k or any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError(f"draft parents {self.parents} for {k} tokens: need one per node, each in "
                                 f"[-1, its own index)")
            if self.parents == chain_parents(k):
                object.__setattr__(self, "parents", None)  # one representation per chain

    @staticmethod
    def chain(tokens: list[int], probs: torch.Tensor | None = None, confidence: torch.Tensor | None = None,
              kind: str | None = None) -> Draft:
        """A sequence draft x_1..x_k: node j's parent is node j - 1."""
        return Draft(tokens, probs, confidence, kind=kind)

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    @property
    def depth(self) -> int:
        """Nodes on the longest root path (a chain's length): the most a round can accept."""
        if self.parents is None:
            return len(self.tokens)
        return max(self.node_depths, default=0)

    @property
    def node_depths(self) -> list[int]:
        """Every node's depth: 1 for a child of the anchor (a chain's node j: j + 1)."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 + (depth[p] if p >= 0 else 0))
        return depth

    @property
    def node_parents(self) -> tuple[int, ...]:
        """Every node's parent index, chains included (-1, 0, ..., k-2)."""
        return chain_parents(len(self.tokens)) if self.parents is None else self.parents

    def truncated(self, n: int) -> Draft:
        """The first n nodes (a subtree: parents come first), with their q rows, confidences and kind."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n],
                     None if self.confidence is None else self.confidence[:n],
                     None if self.parents is None else self.parents[:n], self.kind)

    def keep(self, nodes: list[int]) -> Draft:
        """The listed nodes (ascending, every parent listed before its children) with their q rows, confidences and
        kind, reindexed: a chain's prefix stays a chain, a tree's subtree a tree."""
        if nodes == list(range(len(nodes))) and (self.parents is None or len(nodes) == len(self.tokens)):
            return self.truncated(len(nodes))
        index = {n: i for i, n in enumerate(nodes)}
        parents = self.node_parents
        if any(parents[n] >= 0 and parents[n] not in index for n in nodes) or sorted(index) != nodes:
            raise ValueError(f"nodes {nodes} are not a subtree of the draft (parents {parents})")
        at = torch.tensor(nodes, dtype=torch.long)
        return Draft([self.tokens[n] for n in nodes],
                     None if self.probs is None else self.probs[at.to(self.probs.device)],
                     None if self.confidence is None else self.confidence[at.to(self.confidence.device)],
                     tuple(-1 if parents[n] < 0 else index[parents[n]] for n in nodes), self.kind)


def chain_parents(k: int) -> tuple[int, ...]:
    """The parents of a k-token chain: -1, 0, ..., k-2."""
    return tuple(range(-1, k - 1))


EMPTY_DRAFT = Draft.chain([])


@dataclass(frozen=True)
class Capabilities:
    """What a drafter needs from each round and what it yields, as instance data: decode and the engine read these,
    never the drafter's type or name. A composed drafter (`lookup:SPEC`) declares its inner drafter's."""

    hidden_layers: tuple[int, ...] = ()  # target hidden states it reads (observe/accept), HF `hidden_states` indices
    trees: bool = False  # whether its drafts are trees by default (Draft.parents); False: chains unless asked
    tree_requests: bool = False  # whether it drafts the tree a request asks for (DraftRequest.tree)
    reads_target_kv: bool = False  # whether it reads the target's KV cache (self-speculation)
    # whether it drafts on after missing some positions' hidden states: `observe` may then start past the context it
    # knows, which restarts there (a windowed context that sees recent positions only). The engine skips handing
    # over rows while its draft gate keeps such a drafter's requests plain.
    context_gaps: bool = False
    # whether one forward proposes all of a round's positions (block drafters): drafting positions the dspark cut
    # then drops costs it little, so the engine's dspark policy asks it for k every round, as the library's does
    one_pass: bool = False


NO_NEEDS = Capabilities()


@dataclass(frozen=True)
class Verified:
    """What verification decided for one sequence in one round."""

    seq_id: int
    num_accepted: int  # leading draft tokens that survived
    committed: list[int]  # tokens committed this round (accepted + recovered/bonus), after stop trimming
    # {layer: [r, d]}, if requested: the anchor's and the accepted drafts' rows first (r >= num_accepted + 1), from
    # a tensor no larger than the round's own forward, so a drafter may keep them without copying
    target_hidden: dict[int, torch.Tensor]


class Drafter(ABC):
    """Base class with no-op lifecycle hooks; subclasses implement `propose`."""

    name: ClassVar[str] = ""
    capabilities: Capabilities = NO_NEEDS  # per instance where they depend on its weights or inner drafter

    def start(self, seq_id: int, prompt: list[int]) -> None:
        """A sequence begins (its prompt is `prompt`)."""

    def attach_cache(self, seq_id: int, cache: KVCache) -> None:
        """The target's cache for this sequence, lent read-only to a drafter whose capabilities say
        `reads_target_kv` (after `start`, before the prefill): its rows [0, cache.length) are the committed tokens
        whose keys and values the target has computed, and it never holds a draft when `propose` runs."""

    def observe(self, seq_id: int, start: int, hidden: dict[int, torch.Tensor]) -> None:
        """The target computed hidden states {layer: [T, d]} (`capabilities.hidden_layers`) for committed
        positions start..start+T-1 outside a verification round (the prefill). `start` is where the context it
        knows ends, or past it for a drafter whose capabilities allow `context_gaps`."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One draft per request, each at most its budget long."""

    def accept(self, result: Verified) -> None:
        """Verification of this sequence's last draft is done; roll back anything past the committed prefix."""

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        """The sequence's committed tokens were cut back to its first `num_tokens` (this drafter drafts inside
        another one, whose own verification rejected what this one's rounds committed): forget what lies past
        them. Target hidden states for positions from num_tokens - 1 on come again through `observe`. A no-op for
        drafters that keep no state per position (ngram); the others override it."""

    def finish(self, seq_id: int) -> None:
        """The sequence ended (finished or aborted): free its state."""

    def live_sequences(self) -> set[int]:
        """The sequences this drafter holds state for (between `start` and `finish`): empty when the engine is
        idle (`Engine.check_idle`)."""
        return set()


DrafterFactory = Callable[..., Drafter]
DRAFTERS: dict[str, DrafterFactory] = {}
# name -> f(zoo_dir) giving the spec the benchmark runs for this drafter (None: nothing to run, e.g. no weights)
BENCH_SPECS: dict[str, Callable[[Path], str | None]] = {}
STRUCTURED: set[str] = set()  # drafters whose factories take `options` (structured specs)


def register_drafter(
    name: str, bench_spec: Callable[[Path], str | None] | None = None, structured: bool = False
) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register a factory `f(arg: str | None, *, target, dtype, device) -> Drafter` under `name`; with `structured`
    it also takes `options: dict[str, str]` from a structured spec `name(key=value, ...)` (drafters.spec).

    `bench_spec` tells `verispec bench` how to run this drafter on the zoo (default: the bare name), so every
    registered drafter shows up in the benchmark without editing it.
    """

    def deco(factory: DrafterFactory) -> DrafterFactory:
        DRAFTERS[name] = factory
        BENCH_SPECS[name] = bench_spec or (lambda zoo: name)
        if structured:
            STRUCTURED.add(name)
        return factory

    return deco


def build_drafter(spec: str, *, target: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> Drafter:
    """`spec` is `name`, `name:argument` (e.g. `ngram`, `ngram:4`, `model:path/to/checkpoint`) or a structured
    `name(key=value, ...)` whose values may be specs themselves (drafters.spec)."""
    import verispec.drafters  # noqa: F401  (registers the built-in drafters)

    parsed = parse_spec(spec)
    if parsed.name not in DRAFTERS:
        raise ConfigError(f"unknown drafter {parsed.name!r}; available: {', '.join(sorted(DRAFTERS))}")
    factory = DRAFTERS[parsed.name]
    if parsed.name in STRUCTURED:
        return factory(parsed.arg, target=target, dtype=dtype, device=device, options=parsed.options)
    if parsed.options or (parsed.arg is None and spec.strip().endswith(")")):
        raise ConfigError(f"drafter {parsed.name!r} takes no options: use {parsed.name} or {parsed.name}:ARG")
    return factory(parsed.arg, target=target, dtype=dtype, device=device)
