"""Statistical losslessness of speculative sampling (reliability.md §3.6, checklist A5).

A synthetic order-1 Markov target P and draft Q over V=8 tokens are decoded speculatively with the library's
verifiers; every adjacent position pair of the generated sequences must match the exact joint of P
(_markov.pairwise_failures). The same checker must reject four deliberately broken samplers, which proves the
test has the power to see the bugs it is meant to catch.
"""

from __future__ import annotations

import pytest
import torch
from _markov import markov_logits, pairwise_failures, processed, simulate, tv_limit

from verispec.verify import VerifyOutput, rejection_verify, sample_match_verify

VOCAB = 8
N = 30_000  # sequences per simulation (as one batch); TV limit 2 * sqrt(64 / (2 pi N)) = 0.0369
SEED = 1234

PROCESSING = {
    "T=1": dict(temperature=1.0),
    "T=0.7": dict(temperature=0.7),
    "T=1.3": dict(temperature=1.3),
    "top_k=3": dict(temperature=1.0, top_k=3),
    "top_p=0.8": dict(temperature=1.0, top_p=0.8),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Intra-op threads only slow down these small tensor ops (badly so under CPU contention)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(name: str = "T=1") -> tuple[torch.Tensor, torch.Tensor]:
    """Processed (P, Q): the same temperature / top-k / top-p applied to target and draft logits."""
    target_logits, draft_logits = markov_logits(VOCAB, seed=0)
    return processed(target_logits, **PROCESSING[name]), processed(draft_logits, **PROCESSING[name])


def _check(verify, k: int, name: str = "T=1", drafter: str = "sample", pass_q: bool = True, seed: int = SEED):
    """Simulate L = k + 3 tokens for N sequences and return the checker's failures (empty = lossless)."""
    P, Q = _model(name)
    seqs = simulate(verify, P, Q, k=k, length=k + 3, n=N, seed=seed, drafter=drafter, pass_q=pass_q)
    return pairwise_failures(seqs, P)


def _sample_match(draft_tokens, num_draft, target_probs, draft_probs, generators):
    """sample_match_verify behind rejection_verify's signature (it needs no q)."""
    return sample_match_verify(draft_tokens, num_draft, target_probs, generators)


# ------------------------------------------------------------------------------------------------------------
# Positive tests: the library's verifiers are lossless.


def test_threshold_matches_research_note():
    """The TV limit used here is the calibrated one: 0.0286 for V=8 (64 cells) and N=50k."""
    assert tv_limit(VOCAB * VOCAB, 50_000) == pytest.approx(0.0286, abs=1e-4)


@pytest.mark.parametrize("name", list(PROCESSING))
def test_markov_model_is_informative(name):
    """The toy model exercises both paths: P != Q, per-token acceptance sum(min(p, q)) well inside (0, 1),
    and top-k / top-p really truncate the distributions."""
    P, Q = _model(name)
    acceptance = torch.minimum(P, Q).sum(-1)
    assert bool(((acceptance > 0.2) & (acceptance < 0.95)).all())
    if name.startswith("top_"):
        assert bool(((P > 0).sum(-1) < VOCAB).all()) and bool(((Q > 0).sum(-1) < VOCAB).all())


@pytest.mark.parametrize("name", list(PROCESSING))
@pytest.mark.parametrize("k", [1, 3])
def test_rejection_verify_is_lossless(k, name):
    """rejection_verify with a sampled draft and its soft q reproduces the processed target chain exactly."""
    failures = _check(rejection_verify, k, name)
    assert not failures, failures


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_verify_point_mass_drafter_is_lossless(k):
    """q=None with a deterministic (argmax-of-Q) drafter is lossless (accept w.p. p(x), else p without x)."""
    failures = _check(rejection_verify, k, drafter="argmax", pass_q=False)
    assert not failures, failures


@pytest.mark.parametrize("k", [1, 3])
def test_sample_match_verify_is_lossless(k):
    """sample_match_verify (accept while x_j == y_j ~ p_j) reproduces the target chain exactly."""
    failures = _check(_sample_match, k)
    assert not failures, failures


def test_sample_match_verify_is_lossless_after_top_k():
    """sample_match_verify is lossless for a top-k target, with draft tokens it can never sample."""
    failures = _check(_sample_match, 3, "top_k=3")
    assert not failures, failures


# ------------------------------------------------------------------------------------------------------------
# Broken samplers (negative controls). They share rejection_verify's signature but support only a batch with
# one k and draw all their noise from generators[0] (vectorised: they are controls, not production code).


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    return mask.long().cumprod(dim=1).sum(dim=1)


def _textbook(draft_tokens, num_draft, target_probs, draft_probs, generators, bug: str | None = None):
    """Textbook speculative sampling (Leviathan et al.) with an optional injected bug."""
    batch, k = num_draft.numel(), int(num_draft[0])
    assert bool((num_draft == k).all())
    vocab = target_probs.shape[-1]
    g = generators[0]
    p = target_probs.float().reshape(batch, k + 1, vocab)
    x = draft_tokens.long().reshape(batch, k)
    if draft_probs is None:
        q = torch.nn.functional.one_hot(x, vocab).float()
    else:
        q = draft_probs.float().reshape(batch, k, vocab)
    p_x = p[:, :k].gather(2, x[..., None]).squeeze(2)
    q_x = q.gather(2, x[..., None]).squeeze(2)
    accept = torch.rand(batch, k, generator=g) < p_x / q_x
    if bug == "always_accept":
        accept = torch.ones_like(accept)
    num_accepted = _leading_true(accept)
    rows = torch.arange(batch)
    p_final = p[rows, num_accepted]
    q_final = torch.cat([q, q.new_zeros(batch, 1, vocab)], dim=1)[rows, num_accepted]
    residual = (p_final - q_final).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_final)
    if bug == "resample_from_p":
        residual = p_final
    bonus = p[:, k - 1] if bug == "bonus_wrong_context" else p[:, k]
    final_probs = torch.where((num_accepted < k)[:, None], residual, bonus)
    final = torch.multinomial(final_probs, 1, generator=g).squeeze(1)
    j = torch.arange(k + 1)[None]
    tokens = torch.cat([x, x.new_zeros(batch, 1)], dim=1)
    tokens = torch.where(j < num_accepted[:, None], tokens, -1)
    tokens = torch.where(j == num_accepted[:, None], final[:, None], tokens)
    return VerifyOutput(tokens, num_accepted)


def always_accept_verify(draft_tokens, num_draft, target_probs, draft_probs, generators):
    """BROKEN: accepts every draft token (output follows Q, not P)."""
    return _textbook(draft_tokens, num_draft, target_probs, draft_probs, generators, bug="always_accept")


def resample_from_p_verify(draft_tokens, num_draft, target_probs, draft_probs, generators):
    """BROKEN: on rejection samples from p_j instead of the residual norm(max(0, p_j - q_j))."""
    return _textbook(draft_tokens, num_draft, target_probs, draft_probs, generators, bug="resample_from_p")


def bonus_wrong_context_verify(draft_tokens, num_draft, target_probs, draft_probs, generators):
    """BROKEN: the bonus token is drawn from p_k (last draft position's context) instead of p_{k+1}."""
    return _textbook(draft_tokens, num_draft, target_probs, draft_probs, generators, "bonus_wrong_context")


@pytest.mark.parametrize("k", [1, 3])
def test_textbook_reference_is_lossless(k):
    """The bug-free vectorised reference passes, so each control below fails only because of its bug."""
    failures = _check(_textbook, k)
    assert not failures, failures


@pytest.mark.parametrize(
    "broken",
    [always_accept_verify, resample_from_p_verify, bonus_wrong_context_verify],
    ids=lambda f: f.__name__,
)
@pytest.mark.parametrize("k", [1, 3])
def test_negative_control_is_detected(broken, k):
    """The checker rejects each broken sampler (power against the bugs of reliability.md §3.6)."""
    assert _check(broken, k)


@pytest.mark.parametrize("k", [1, 3])
def test_negative_control_soft_q_for_point_mass_drafter_is_detected(k):
    """Passing the soft Q for a drafter that really proposes argmax Q (a point mass) is lossy: detected."""
    assert _check(rejection_verify, k, drafter="argmax", pass_q=True)
