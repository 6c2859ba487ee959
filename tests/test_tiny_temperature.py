"""Degenerate but valid sampling parameters (issue 19, defect 2): a temperature so small that softmax(l / T) is a
point mass to fp32 precision (1e-38 ... 5e-324), or a top_p below fp32's range (1e-50), must give that point mass
on the argmax, so the output equals greedy decoding's, through the sampler, the verifiers, every drafter that
computes q, the reference loop, LLM.generate and the engine. Before the fix l / T overflowed to inf, softmax made
NaN, and the exponential race drew token 0 every time.

`finite_sampling` asserts that every distribution reaching a sampling call is a finite distribution.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import tiny_model
from test_block_drafter import make_block

from verispec import sampling
from verispec.api import LLM
from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import BlockDrafter, ModelDrafter, NgramDrafter
from verispec.drafters.block import save_block_drafter
from verispec.engine import Engine
from verispec.errors import ConfigError
from verispec.model import load_model, save_model

TINY_TEMPERATURES = (1e-38, 1e-40, 1e-45, 5e-324)
# Each must give greedy's tokens: the issue's temperatures, top_p below fp32's range, and both with top-k.
DEGENERATE = [
    dict(temperature=1e-40), dict(temperature=5e-324), dict(temperature=1e-38),
    dict(temperature=1.0, top_p=1e-50), dict(temperature=0.7, top_p=5e-324, top_k=20),
    dict(temperature=1e-300, top_p=0.9, top_k=5),
]
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 44, 17, 90, 2, 61, 28], [7]]


def assert_distribution(probs: torch.Tensor) -> None:
    """probs [..., V] is a distribution per row: finite, non-negative, summing to 1."""
    assert bool(torch.isfinite(probs).all()), "non-finite probabilities reached a sampling call"
    assert bool((probs >= 0).all()), "negative probabilities reached a sampling call"
    sums = probs.double().sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-4, rtol=0)


@pytest.fixture
def finite_sampling(monkeypatch) -> list[int]:
    """Wrap sampling.sample, wherever a verispec module bound it, with assert_distribution; yields a one-item call
    count, so a test can check that sampling ran at all."""
    real, calls = sampling.sample, [0]

    def checked(probs, generator):
        assert_distribution(probs)
        calls[0] += 1
        return real(probs, generator)

    for name, module in list(sys.modules.items()):
        if name.startswith("verispec") and getattr(module, "sample", None) is real:
            monkeypatch.setattr(module, "sample", checked)
    return calls


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(sampling.greedy(logits), logits.shape[-1]).float()


# ---- the sampler ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperature_is_the_argmax_point_mass(temperature, dtype):
    """softmax(l / T) at a T whose exp((l_2 - l_1) / T) underflows is the point mass on the argmax, with or without
    top-k and top-p, for fp32 and bf16 logits (no inf, no NaN)."""
    logits = (torch.randn(8, 50, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    for top_k, top_p in [(0, 1.0), (5, 1.0), (0, 0.5), (3, 0.9)]:
        probs = sampling.logits_to_probs(logits, temperature, top_k, top_p)
        assert torch.equal(probs, one_hot_argmax(logits)), (top_k, top_p)


@pytest.mark.parametrize("top_p", [1e-50, 5e-324, 1e-30, 1e-8])
def test_tiny_top_p_keeps_the_argmax(top_p):
    """A top_p below any token's mass keeps the most likely token alone, even where top_p rounds to 0 in fp32."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 2
    for temperature in (0.5, 1.0, 3.0):
        assert torch.equal(sampling.logits_to_probs(logits, temperature, top_p=top_p), one_hot_argmax(logits))


def test_tiny_top_p_breaks_ties_as_greedy_does():
    """Equal top logits: top-p's sort is stable, so a tiny top_p keeps the lowest token id, greedy's choice."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    probs = sampling.logits_to_probs(logits, 1.0, top_p=1e-50)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_tiny_temperature_ties_share_the_mass():
    """Exact ties share the mass at every T > 0, so also at a tiny one: that is softmax(l / T), and sampling from it
    is exact (ties are unlikely in fp32 logits; bf16 logits tie more often)."""
    probs = sampling.logits_to_probs(torch.tensor([[0.0, 2.0, 2.0, 1.0]]), 1e-40)
    assert probs.tolist() == [[0.0, 0.5, 0.5, 0.0]]


@pytest.mark.parametrize("temperature", [0.05, 1e-3, 1e-6, 2e-38])
def test_small_temperatures_follow_softmax(temperature):
    """Between ordinary and point-mass temperatures (some tokens underflow, others not) the result is
    softmax(l / T) computed in float64; 2e-38 is just above fp32's smallest normal, where fp32 division is kept."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 40, generator=g) * 3
    logits[:, 7] = logits.max(-1).values + 3 * temperature  # a runner-up within a few T of the top
    logits[:, 9] = logits[:, 7] + 2 * temperature
    probs = sampling.logits_to_probs(logits, temperature)
    assert_distribution(probs)
    expected = torch.softmax(logits.double() / temperature, -1)
    torch.testing.assert_close(probs.double(), expected, atol=1e-5, rtol=1e-4)


def test_non_finite_temperature_is_refused():
    """NaN and inf temperatures have no distribution: SamplingParams and logits_to_probs refuse them."""
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ConfigError, match="temperature"):
            SamplingParams(temperature=bad)
        with pytest.raises(ValueError):
            sampling.logits_to_probs(torch.zeros(1, 4), bad)


# ---- LLM.generate, every drafter ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_dirs(tmp_path_factory, tokenizer):
    """A target checkpoint, a second model to draft with, and a DSpark (Markov head) block drafter for it."""
    root = tmp_path_factory.mktemp("tiny-t")
    save_model(tiny_model(vocab_size=tokenizer.vocab_size), root / "target")
    tokenizer.save(root / "target")
    save_model(tiny_model(5, vocab_size=tokenizer.vocab_size), root / "draft")
    tokenizer.save(root / "draft")
    target = load_model(root / "target")
    save_block_drafter(make_block(target, head="markov", confidence=True), root / "dspark")
    return root


@pytest.mark.parametrize("drafter", [None, "ngram", "model", "model:draft", "dspark:dspark"])
def test_degenerate_params_give_greedy_through_llm(drafter, llm_dirs, finite_sampling):
    """SamplingParams(temperature=1e-40 / 5e-324 / 1e-38, or top_p=1e-50, ...) through LLM.generate gives greedy's
    tokens, plainly and with each drafter; no NaN reaches a sampling call."""
    spec = drafter and drafter.replace("model:", f"model:{llm_dirs}/").replace("dspark:", f"dspark:{llm_dirs}/")
    llm = LLM(llm_dirs / "target", dtype="fp32", drafter=spec, k=4)
    prompt = "def add(a, b):\n    return a + b\n"
    greedy = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True), plain=True)[0].token_ids
    for kw in DEGENERATE:
        res = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True, seed=3, **kw))[0]
        assert res.token_ids == greedy, kw
        if drafter is not None:
            assert res.stats.num_drafts > 0 or drafter == "ngram"
    assert finite_sampling[0] > 0


@pytest.mark.parametrize("drafter", ["ngram", "model:draft", "dspark:dspark"])
def test_sampled_runs_feed_only_distributions_to_the_sampler(drafter, llm_dirs, finite_sampling):
    """Ordinary sampling (target p, draft q, residuals) with each drafter hands sample() finite distributions."""
    spec = drafter.replace("model:", f"model:{llm_dirs}/").replace("dspark:", f"dspark:{llm_dirs}/")
    llm = LLM(llm_dirs / "target", dtype="fp32", drafter=spec, k=4)
    for verify in ("rejection", "sample-match"):
        llm.spec = SpecConfig(k=4, verify=verify)
        for kw in (dict(temperature=0.8), dict(temperature=1.3, top_k=20, top_p=0.9)):
            llm.generate("class Point:", SamplingParams(max_tokens=16, ignore_eos=True, seed=1, **kw))
    assert finite_sampling[0] > 0


# ---- the engine -------------------------------------------------------------------------------------------------


def test_degenerate_params_give_greedy_in_the_engine(finite_sampling):
    """In one engine batch, next to greedy and ordinarily sampled requests, every degenerate request commits
    greedy's tokens, with no drafter, ngram, a model drafter and a DSpark drafter."""
    target, other = tiny_model(0, 0.2), tiny_model(123, 0.5)
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = [decode(target, p, greedy).token_ids for p in PROMPTS]
    drafters = {"random": ModelDrafter(other), "self": ModelDrafter(target),
                "dspark": BlockDrafter(make_block(target, head="markov", confidence=True), target)}
    engine = Engine(target, None, EngineConfig(k=3, drafter="ngram", prefill_chunk=8), drafters=drafters)
    expected = {}
    for i, kw in enumerate(DEGENERATE):
        for j, name in enumerate(("none", "ngram", "random", "self", "dspark")):
            n = (i + j) % len(PROMPTS)
            params = SamplingParams(max_tokens=16, ignore_eos=True, seed=i, **kw)
            expected[engine.add_request(PROMPTS[n], params, RequestSpec(drafter=name))] = plain[n]
    engine.add_request(PROMPTS[0], greedy, RequestSpec(drafter="self"))
    sampled = SamplingParams(max_tokens=16, temperature=0.9, seed=5)
    engine.add_request(PROMPTS[1], sampled, RequestSpec(drafter="random"))
    results = engine.run_until_done()
    for rid, want in expected.items():
        assert results[rid].token_ids == want, rid
    assert finite_sampling[0] > 0


def test_reference_loop_and_verifiers_with_a_tiny_temperature(finite_sampling):
    """decode() with a drafter whose q is a tiny-temperature distribution (a model drafter at T = 1e-40 versus the
    random drafter it shares no weights with: drafts are rejected and residuals drawn) equals greedy."""
    target, other = tiny_model(0, 0.2), tiny_model(123, 0.5)
    for prompt in PROMPTS:
        want = decode(target, prompt, SamplingParams(max_tokens=16, ignore_eos=True)).token_ids
        for drafter, verify in [(ModelDrafter(other), "rejection"), (ModelDrafter(other), "sample-match"),
                                (NgramDrafter(), "rejection")]:
            params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=1e-40, seed=0)
            got = decode(target, prompt, params, drafter=drafter, spec=SpecConfig(k=4, verify=verify))
            assert got.token_ids == want
