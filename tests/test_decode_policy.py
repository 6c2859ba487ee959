"""SpecConfig.policy = "dspark" in the single-sequence loop: each round verifies the draft prefix DSpark's
Algorithm 1 picks. Exact whatever it cuts (greedy equality, the sampling statistics), and the cut it makes is
the one the rule defines, from the drafter's confidences or from past acceptance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from test_block_drafter import make_block
from test_exactness import S_N, S_PARAMS, S_PROMPT, SV, exact_pair_joints, failures

from verispec.config import SamplingParams, SpecConfig
from verispec.decode import _LengthPolicy, decode
from verispec.drafters import Draft, ModelDrafter, NgramDrafter
from verispec.drafters.block import BlockDrafter
from verispec.errors import ConfigError
from verispec.profile import StepProfile

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 44, 17, 90, 2, 61, 28]]
GREEDY = SamplingParams(max_tokens=36, ignore_eos=True)


def linear_profile(per_token: float, tokens: int = 16) -> StepProfile:
    """A step of B tokens costs 1 + per_token * B seconds: the dearer a token, the shorter the verified draft."""
    bs = tuple(range(1, tokens + 1))
    return StepProfile({}, bs, tuple(1.0 + per_token * b for b in bs), 0.0, 0)


@pytest.fixture
def cuts(monkeypatch):
    """Counts the rounds the policy shortened and the rounds it verified whole."""
    counts = {"cut": 0, "whole": 0}
    original = _LengthPolicy.cut

    def counting(self, draft, context=0):
        out = original(self, draft, context)
        counts["cut" if len(out.tokens) < len(draft.tokens) else "whole"] += 1
        return out

    monkeypatch.setattr(_LengthPolicy, "cut", counting)
    return counts


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, 0.2)


@pytest.fixture(scope="module")
def plain(target):
    return [decode(target, p, GREEDY).token_ids for p in PROMPTS]


def make_drafter(kind: str, target):
    if kind == "ngram":
        return NgramDrafter()
    if kind == "self":  # accepted nearly always: the rule must still cut where tokens are dear
        return ModelDrafter(target)
    if kind == "random":
        return ModelDrafter(tiny_model(123, 0.5))
    if kind == "dspark":  # with a confidence head: the cut follows its per-position estimates
        return BlockDrafter(make_block(target, head="markov", confidence=True, block_size=8), target)
    if kind == "parallel":  # no confidence: the cut follows past acceptance
        return BlockDrafter(make_block(target, block_size=8), target)
    raise ValueError(kind)


@pytest.mark.parametrize("per_token", [0.05, 0.3])
@pytest.mark.parametrize("k", [2, 8])
@pytest.mark.parametrize("kind", ["ngram", "self", "random", "dspark", "parallel"])
def test_greedy_equals_plain_with_the_dspark_policy(kind, k, per_token, target, plain, cuts):
    """A1: whatever prefix the policy verifies, fp32 greedy output equals plain decoding token for token."""
    for prompt, ref in zip(PROMPTS, plain):
        res = decode(target, prompt, GREEDY, drafter=make_drafter(kind, target),
                     spec=SpecConfig(k=k, policy="dspark"), profile=linear_profile(per_token))
        assert res.token_ids == ref
        assert res.stats.num_output_tokens == GREEDY.max_tokens
    assert cuts["whole"] + cuts["cut"] > 0
    if per_token == 0.3 and kind != "self":
        assert cuts["cut"] > 0  # the equality above covers rounds the rule shortened


def test_cut_follows_the_rule():
    """Unit: with confidences 0.9, 0.9, 0.2, ... and a token costing a tenth of a step, positions are admitted
    while tau(n) / step(n + 1) still grows; the third (survival 0.16) does not pay for its row."""
    policy = _LengthPolicy(None, 8, linear_profile(0.1))
    draft = Draft([1, 2, 3, 4], None, torch.tensor([0.9, 0.9, 0.2, 0.9]))
    # tau/step: n=0 1/1.1=0.909, n=1 1.9/1.2=1.583, n=2 2.71/1.3=2.085, n=3 2.872/1.4=2.051 -> stop at 2
    assert policy.cut(draft).tokens == [1, 2]
    assert policy.cut(draft).confidence.tolist() == pytest.approx([0.9, 0.9])
    cheap = _LengthPolicy(None, 8, linear_profile(0.001))
    assert cheap.cut(draft).tokens == [1, 2, 3, 4]


def test_cut_counts_the_drafters_cost():
    """The drafter's measured time per round is part of the step: a costly drafter makes each verified token
    relatively cheaper, so the same confidences keep a longer prefix."""
    draft = Draft([1, 2, 3], None, torch.tensor([0.5, 0.5, 0.5]))
    policy = _LengthPolicy(None, 8, linear_profile(1.0))
    assert policy.cut(draft).tokens == []  # n = 0: 1 / 2 = 0.5; n = 1: 1.5 / 3 = 0.5, no gain
    policy.record(20.0, 0, Draft([]), [])  # a 20 s drafter: 1 / 22, 1.5 / 23, 1.75 / 24, 1.875 / 25 keep growing
    assert policy.cut(draft).tokens == [1, 2, 3]


def test_without_confidence_past_acceptance_decides():
    """A drafter without confidences: every proposal the target's continuation contradicts at position 1 drives
    the estimate down until the rule verifies nothing; proposals it would have accepted, scored against the
    committed tokens although nothing was verified, bring it back."""
    policy = _LengthPolicy(None, 4, linear_profile(0.3))
    draft = Draft([1, 2, 3, 4])
    assert policy.cut(draft).tokens == [1]  # prior 0.5: 1 / 1.3 < 1.5 / 1.6 > 1.75 / 1.9
    tokens = [7]
    for _ in range(20):  # the target continues with 9s: position 1 always wrong
        policy.record(0.0, len(tokens), draft, tokens)
        tokens += [9]
    assert policy.cut(draft).tokens == []
    for _ in range(40):  # cut to nothing, the proposals still match what the target went on to commit
        start = len(tokens)
        tokens += [1, 2, 3, 4]
        policy.record(0.0, start, draft, tokens)
    assert policy.cut(draft).tokens == [1, 2, 3, 4]
    policy.record(0.0, len(tokens), Draft([1, 2]), tokens)  # not covered yet: waits for the tokens
    assert len(policy.shadow) == 1


def test_draft_kinds_are_cut_by_their_own_past():
    """Drafts of two kinds from one drafter (prompt lookup after a 1-token and a 3-token match): one always
    contradicted, one always right. Each kind's cut follows its own record, not their mix."""
    policy = _LengthPolicy(None, 4, linear_profile(0.3))
    weak, strong = Draft.chain([1, 2, 3, 4], kind="n1"), Draft.chain([1, 2, 3, 4], kind="n3")
    tokens = [7]
    for _ in range(30):
        policy.record(0.0, len(tokens), weak, tokens)
        tokens += [9]
        start = len(tokens)
        tokens += [1, 2, 3, 4]
        policy.record(0.0, start, strong, tokens)
    assert policy.cut(weak).tokens == [] and policy.cut(strong).tokens == [1, 2, 3, 4]


def test_policy_option_is_checked():
    with pytest.raises(ConfigError, match="policy"):
        SpecConfig(policy="greedy")


@pytest.fixture(scope="module")
def stat_target():
    return tiny_model(0, 0.25, vocab_size=SV, max_position_embeddings=16, num_hidden_layers=1)


@pytest.mark.parametrize("kind", ["dspark-confidence", "model-acceptance"])
def test_sampling_with_the_dspark_policy_follows_the_target(kind, stat_target, cuts):
    """A5: seeded runs at temperature 1 with drafts cut by the rule (from confidences that depend on the tokens
    before each position, or from past acceptance): (x1, x2) and (x2, x3) follow the target's exact joints."""
    n = S_N
    if kind == "dspark-confidence":
        model = make_block(stat_target, head="markov", confidence=True, block_size=2, std=0.5)
        with torch.no_grad():  # confidences near 1/2 (random weights saturate them), so the cut is often at 1
            model.confidence_head.weight.mul_(0.1)
            model.confidence_head.bias.zero_()
        drafter = BlockDrafter(model, stat_target)
        make = lambda: drafter  # noqa: E731 - one drafter, sequences start and finish in turn
    else:
        draft_model = tiny_model(1, 0.25, vocab_size=SV, max_position_embeddings=16, num_hidden_layers=1)
        make = lambda: ModelDrafter(draft_model)  # noqa: E731
    profile = linear_profile(1.0)  # position 1 pays for itself only above survival 1/2: both sides happen
    samples = np.empty((n, 3), dtype=np.int64)
    for i in range(n):
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=i)
        res = decode(stat_target, S_PROMPT, params, drafter=make(), spec=SpecConfig(k=2, policy="dspark"),
                     profile=profile)
        samples[i] = res.token_ids
    assert cuts["cut"] > n // 10 and cuts["whole"] > n // 10  # both sides of the rule, often
    assert failures(samples, exact_pair_joints(stat_target, S_PROMPT, S_PARAMS)) == []


def test_step_profile_never_gets_cheaper_with_more_tokens():
    """A measured dip (the machine's noise) is flattened: the rule would otherwise favour a noisy row count."""
    prof = StepProfile({}, (1, 2, 4, 8), (1.0, 1.4, 1.2, 2.0), 0.0, 0)
    assert prof.step_time(4) == pytest.approx(1.4) and prof.step_time(3) == pytest.approx(1.4)
    assert prof.step_time(6) == pytest.approx(1.7)


def test_step_time_grows_with_the_context_past_the_measured_one():
    """The profile's context axis: attention adds (C - context) * (kv_read_s * R + kv_row_s * B) past the measured
    context, nothing at or below it; the dspark cut reads it, so a long context makes long drafts cost more."""
    prof = StepProfile({}, (1, 8, 16), (1.0, 1.2, 1.6), 0.0, 100, kv_read_s=0.001, kv_row_s=0.0005)
    assert prof.step_time(8) == prof.step_time(8, context=50) == prof.step_time(8, context=100) == pytest.approx(1.2)
    assert prof.step_time(8, context=1100) == pytest.approx(1.2 + 1000 * (0.001 + 0.0005 * 8))
    assert prof.step_time(8, 2, context=1100) == pytest.approx(1.2 + 1000 * (0.002 + 0.0005 * 8))
    again = StepProfile.from_json(prof.to_json())
    assert again.step_time(16, context=600) == pytest.approx(prof.step_time(16, context=600))
    target = tiny_model()
    # Attention's compute per verified token dominating at 3,000 positions: fewer tokens pay there.
    policy = _LengthPolicy(target, 4, StepProfile({}, (1, 8, 16), (1.0, 1.2, 1.6), 0.0, 100, kv_row_s=0.01))
    draft = Draft.chain([1, 2, 3, 4], confidence=torch.full((4,), 0.9))
    assert len(policy.cut(draft, context=100).tokens) > len(policy.cut(draft, context=3000).tokens)


def test_a_disturbed_profile_is_used_but_not_cached(monkeypatch, tmp_path):
    """Even token counts 2x their odd neighbours (seen while another process kept both cores busy): load_or_measure
    returns it for this process and measures again in the next; a clean one is cached."""
    import verispec.profile as profile

    monkeypatch.setattr(profile, "cache_dir", lambda: tmp_path)
    target = tiny_model(max_position_embeddings=512)
    for jagged in (True, False):
        def fake(target, caches, lengths, context, jagged=jagged):
            rows = sum(lengths)
            return 1e-3 + 1e-4 * rows + (2e-3 if jagged and rows % 2 == 0 and len(lengths) == 1 else 0.0)

        monkeypatch.setattr(profile, "_time_step", fake)
        prof = profile.load_or_measure(target)
        assert profile.disturbed(prof) is jagged
        assert profile.cache_path(profile.profile_key(target)).is_file() is not jagged


def test_a_profile_measured_with_other_kernels_is_measured_again(monkeypatch, tmp_path):
    """Step costs depend on the kernels that ran them: a profile cached before a kernel source changed is not
    reused (the key carries native.source_digest()); with the same sources it is."""
    import verispec.profile as profile
    from verispec.kernels import native

    monkeypatch.setattr(profile, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(profile, "_time_step", lambda target, caches, lengths, context: 1e-3 + 1e-4 * sum(lengths))
    target = tiny_model(max_position_embeddings=512)
    first = profile.load_or_measure(target)
    assert profile.load_or_measure(target).key == first.key  # cached, read back
    if not native.available():  # torch's forward: no kernel sources to record
        assert first.key["kernel_sources"] is None
        return
    monkeypatch.setitem(native._state, "sources", "0123456789abcdef")  # as if a kernel source had changed
    key = profile.profile_key(target)
    assert key != first.key and not profile.cache_path(key).is_file()


def test_measured_profile_fits_the_context_axis(monkeypatch):
    """measure() fits kv_read_s and kv_row_s from its long-context probe: on a synthetic step cost with known
    coefficients it recovers them (timing noise left out)."""
    import verispec.profile as profile

    def fake(target, caches, lengths, context):
        rows = sum(lengths)
        return 1e-3 + 1e-4 * rows + 5e-5 * (len(lengths) - 1) + context * (2e-6 * len(lengths) + 1e-7 * rows)

    monkeypatch.setattr(profile, "_time_step", fake)
    target = tiny_model(max_position_embeddings=512)
    prof = profile.measure(target, token_counts=(1, 2, 4, 8, 16), context=8, repeats=1)
    assert prof.kv_read_s == pytest.approx(2e-6) and prof.kv_row_s == pytest.approx(1e-7)
    assert prof.per_request_s == pytest.approx((5e-5 * 7 + 8 * 7 * 2e-6 - 7e-4 + 7e-4) / 7, rel=1e-6)
    assert prof.step_time(4, context=408) == pytest.approx(fake(None, [None], [4], 408), rel=1e-6)
