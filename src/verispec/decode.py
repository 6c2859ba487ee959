"""The single-sequence reference loop: plain and speculative decoding, and the oracle for faster paths.

Invariant: the target's cache holds every committed token but the last (the anchor). Each round feeds
[anchor, x_1..x_k] in one forward, verifies, rolls the cache back to the accepted path and commits
num_accepted + 1 tokens. Plain decoding is the same loop with k = 0, so both share prefill and step shapes. A tree
draft's forward carries its positions and tree attention mask, and its cache keeps the accepted path's rows
(round.tree_inputs, round.keep_accepted); nothing else in the loop depends on the draft's shape.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from verispec import policies
from verispec.cache import KVCache
from verispec.config import SamplingParams, SpecConfig
from verispec.drafters.base import EMPTY_DRAFT, Draft, Drafter, DraftRequest, Verified
from verispec.errors import ConfigError
from verispec.metrics import SpecStats
from verispec.model.tokenizer import Tokenizer
from verispec.model.transformer import Transformer
from verispec.profile import StepProfile, load_or_measure
from verispec.round import check_draft, keep_accepted, lend_cache, path_rows, tree_inputs, verify_round
from verispec.sampling import make_generator
from verispec.stopping import StopChecker


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" | "length"
    stop_reason: str | int | None
    stats: SpecStats = field(default_factory=SpecStats)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "stats": self.stats.to_dict(),
        }


@dataclass(frozen=True)
class StreamEvent:
    token_ids: list[int]  # tokens committed this round (after stop trimming)
    text: str  # text delta ("" without a tokenizer)
    result: GenerationResult | None = None  # set on the last event


def validate_prompt(prompt_ids: list[int], vocab_size: int, context_limit: int) -> None:
    if not prompt_ids:
        raise ConfigError("the prompt is empty")
    if len(prompt_ids) >= context_limit:
        raise ConfigError(
            f"the prompt has {len(prompt_ids)} tokens; the context limit is {context_limit}, "
            f"so at most {context_limit - 1} prompt tokens leave room to generate"
        )
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ConfigError(f"prompt token id {bad} is outside the vocabulary (size {vocab_size})")


_SEQUENCES = itertools.count()


class _LengthPolicy:
    """SpecConfig.policy == "dspark" for one sequence: DSpark's Algorithm 1 with one request (`policies.dspark_cut`,
    the engine's rule for a step of one request). Each round verifies the draft prefix (a tree: the subtree) that
    maximises expected tokens per second, tau(n) / (draft_s + step_time(n + 1, context)), admitting position j only
    while it still raises that ratio: the cut at j depends on c_1..c_j alone (each c_j on the tokens before x_j),
    never on x_j, so sampling stays lossless. c_j is the drafter's confidence where it gives one, else this
    sequence's past acceptance at position j (a tree node's: at its depth) for drafts of its kind, learnt from whole
    chain proposals (`policies.learn_from_proposals`). Given the caller's `estimator`, this sequence's estimate
    shrinks toward what earlier sequences with the same drafter learnt, as a request's does in the engine."""

    def __init__(self, target: Transformer, k: int, profile: StepProfile | None = None,
                 estimator: policies.AcceptanceEstimator | None = None) -> None:
        self.profile = profile or load_or_measure(target)
        self.estimator = estimator or policies.AcceptanceEstimator(k)
        self.key = f"decode-{next(_SEQUENCES)}"  # this sequence's own estimate in a shared estimator
        # proposals not yet covered by committed tokens: (start, tokens, Draft.kind)
        self.shadow: deque[tuple[int, list[int], str | None]] = deque()
        self.propose_s, self.proposals = 0.0, 0  # the drafter's cost per round, as measured so far

    def cut(self, draft: Draft, context: int = 0) -> Draft:
        """`context`: the positions the verify step attends to (its cost grows with them)."""
        if not draft.tokens:
            return draft
        fixed_s = self.propose_s / self.proposals if self.proposals else 0.0
        conditional = policies.conditional(draft, self.estimator, "", self.key)
        return policies.dspark_cut([draft], [conditional], (), 0,
                                   lambda b: fixed_s + self.profile.step_time(b, context=context))[0]

    def record(self, propose_s: float, start: int, proposed: Draft, tokens: list[int]) -> None:
        """After a round: the drafter's time, and its whole proposal (from index `start` of `tokens`; a chain's, trees
        do not teach), scored against the committed tokens as soon as they cover it."""
        if propose_s > 0:  # the drafter ran this round (budget > 0)
            self.propose_s += propose_s
            self.proposals += 1
        if proposed.tokens and proposed.is_chain:
            self.shadow.append((start, proposed.tokens, proposed.kind))
        policies.learn_from_proposals(self.estimator, "", self.key, self.shadow, tokens)

    def finish(self) -> None:
        self.estimator.forget(self.key)


def _rounds(
    target: Transformer,
    prompt_ids: list[int],
    params: SamplingParams = SamplingParams(),
    drafter: Drafter | None = None,
    spec: SpecConfig = SpecConfig(),
    tokenizer: Tokenizer | None = None,
    eos_token_ids: tuple[int, ...] | None = None,
    context_limit: int | None = None,
    seq_id: int = 0,
    profile: StepProfile | None = None,
    estimator: policies.AcceptanceEstimator | None = None,
) -> Iterator[StreamEvent]:
    """decode_stream's loop, to be run under torch.inference_mode()."""
    start = time.perf_counter()
    limit = min(context_limit or target.config.context_limit, target.config.context_limit)
    validate_prompt(prompt_ids, target.config.vocab_size, limit)
    if drafter is not None and spec.tree is not None and spec.tree.enabled and not (
            drafter.capabilities.trees or drafter.capabilities.tree_requests):
        raise ConfigError("this drafter drafts chains only; a tree needs model, eagle, mtp, medusa, dspark or block "
                          "(not an RNN head)")
    if eos_token_ids is None:
        eos_token_ids = tokenizer.eos_token_ids if tokenizer and tokenizer.eos_token_ids else target.config.eos_token_id
    stopper = StopChecker(params, len(prompt_ids), limit, eos_token_ids, tokenizer, prompt_ids)
    generator = None if params.greedy else make_generator(params.seed, target.device)
    stats = SpecStats()
    policy = (_LengthPolicy(target, spec.k, profile, estimator) if drafter is not None and spec.policy == "dspark"
              else None)
    # Room for the prompt, every output token and one round's draft: no need to zero the whole context.
    cache = KVCache.for_model(target, max_len=min(limit, len(prompt_ids) + params.max_tokens + spec.k + 1),
                              tier=spec.kv_tier)
    hidden_layers = drafter.capabilities.hidden_layers if drafter else ()
    device = target.device
    prefill_hidden: dict[int, torch.Tensor] = {}
    if len(prompt_ids) > 1:
        t0 = time.perf_counter()
        with cache.resident():
            _, prefill_hidden = target(torch.tensor([prompt_ids[:-1]], device=device), cache=cache, num_logits=0,
                                       hidden_layers=hidden_layers)
        stats.prefill_s = time.perf_counter() - t0
    tokens = list(prompt_ids)
    if drafter is not None:
        t0 = time.perf_counter()
        drafter.start(seq_id, tokens)
        lend_cache(drafter, seq_id, cache)
        if prefill_hidden:
            drafter.observe(seq_id, 0, {k: v[0] for k, v in prefill_hidden.items()})
        stats.draft_s += time.perf_counter() - t0
    try:
        while True:
            n = len(tokens)
            # Never draft past max_tokens or the context: the bonus token needs room too.
            budget = min(spec.k, params.max_tokens - len(stopper.output) - 1, limit - n - 1)
            draft, proposed, propose_s = EMPTY_DRAFT, EMPTY_DRAFT, 0.0
            cache.prefetch()  # a tiered cache's copy-in overlaps the drafting
            if drafter is not None and budget > 0:
                t0 = time.perf_counter()
                request = DraftRequest(seq_id, tokens, budget, params, generator, spec.tree)
                draft = proposed = drafter.propose([request])[0]
                propose_s = time.perf_counter() - t0
                stats.draft_s += propose_s
                check_draft(draft, budget, target.config.vocab_size, drafter)
                if policy is not None:  # a chain to a prefix, a tree to a subtree
                    draft = policy.cut(draft, n)
            inp = torch.tensor([[tokens[-1], *draft.tokens]], device=device)
            tree = tree_inputs(draft, cache, 1, device)
            shape = {} if tree is None else {"positions": tree[0][None], "attn_mask": tree[1]}
            with cache.resident():
                logits, hidden = target(inp, cache=cache, hidden_layers=hidden_layers, **shape)
            verdict = verify_round(logits[0], draft, params, spec.verify, generator)
            num_accepted = verdict.num_accepted
            keep_accepted(cache, draft, verdict, n)
            emitted = stopper.extend(verdict.tokens)
            tokens.extend(emitted.token_ids)
            stats.record_round(len(draft.tokens), num_accepted, len(emitted.token_ids), draft.depth)
            if policy is not None:
                policy.record(propose_s, n, proposed, tokens)
            if stats.num_rounds == 1:
                stats.ttft_s = time.perf_counter() - start
            if drafter is not None:
                t0 = time.perf_counter()
                verified = path_rows({k: v[0] for k, v in hidden.items()}, draft, verdict)
                drafter.accept(Verified(seq_id, num_accepted, emitted.token_ids, verified))
                stats.draft_s += time.perf_counter() - t0
            if emitted.finish_reason is None:
                yield StreamEvent(emitted.token_ids, emitted.text)
                continue
            stats.elapsed_s = time.perf_counter() - start
            result = GenerationResult(
                prompt_token_ids=list(prompt_ids),
                token_ids=list(stopper.output),
                text=stopper.text if tokenizer is not None else None,
                finish_reason=emitted.finish_reason,
                stop_reason=emitted.stop_reason,
                stats=stats,
            )
            yield StreamEvent(emitted.token_ids, emitted.text, result)
            return
    finally:
        if drafter is not None:
            drafter.finish(seq_id)
        if policy is not None:
            policy.finish()


@torch.inference_mode()  # on a generator function, torch re-enters the mode around every round's resume
def decode_stream(
    target: Transformer, prompt_ids: list[int], params: SamplingParams = SamplingParams(), **kwargs
) -> Iterator[StreamEvent]:
    """Generate for one sequence, yielding each round's committed tokens; the last event carries the result.
    kwargs: drafter, spec, tokenizer, eos_token_ids, context_limit, seq_id, profile (the target's StepProfile for
    `spec.policy == "dspark"`; default: measured once and cached) and estimator (a `policies.AcceptanceEstimator` the
    caller keeps across generations with this drafter, as `LLM` does; default: this generation's alone)."""
    yield from _rounds(target, prompt_ids, params, **kwargs)


def decode(
    target: Transformer, prompt_ids: list[int], params: SamplingParams = SamplingParams(), **kwargs
) -> GenerationResult:
    """Run `decode_stream` to the end and return its result."""
    with torch.inference_mode():  # entered once: decode_stream's resumes each enter and leave it (~20 us a round)
        for event in _rounds(target, prompt_ids, params, **kwargs):
            if event.result is not None:
                return event.result
    raise AssertionError("decode_stream ended without a result")
