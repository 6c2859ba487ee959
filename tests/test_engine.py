"""The serving engine against the reference loop (DESIGN.md "engine step"; reliability.md §5 A1, A5, A6, C1, C2, E).

Per request, the engine's output equals `decode`'s: fp32 greedy token for token, and seeded sampling draw for
draw at the same k, whatever else is in the batch (staggered arrivals, mixed drafters and k, aborts, chunked
prefill). With the dspark policy the verified length changes from step to step, so sampling is checked
statistically against the target's exact joint instead.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from _drafters import CorruptedOracle
from _markov import tv_limit
from conftest import tiny_model
from test_exactness import ALPHA, S_PARAMS, S_PROMPT, SV, check_pair, exact_pair_joints

from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import Draft, ModelDrafter
from verispec.engine import Engine
from verispec.errors import ConfigError, QueueFull
from verispec.policies import AcceptanceEstimator, dspark_lengths, survival
from verispec.profile import StepProfile, measure

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6],
    [3, 44, 17, 90, 2, 61, 28],
    [1, 2, 3] * 6,
    [50],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33],
]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
# Step times with a shelf and a steep rise, so dspark keeps some positions and cuts others.
PROFILE = StepProfile({}, (1, 4, 8, 16, 64), (1.0, 1.1, 1.6, 3.0, 12.0), 0.05, 0)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, 0.2)


@pytest.fixture(scope="module")
def other():
    return tiny_model(123, 0.5)


@pytest.fixture(scope="module")
def plain(target):
    return [decode(target, p, GREEDY).token_ids for p in PROMPTS]


def make_engine(target, other, **cfg) -> Engine:
    drafters = {"self": ModelDrafter(target), "random": ModelDrafter(other)}
    return Engine(target, None, EngineConfig(**cfg), drafters=drafters, profile=PROFILE)


def run_checked(engine: Engine, arrivals: dict[int, list[tuple]]) -> dict[str, object]:
    """Step the engine, adding requests at the given steps, checking the cache invariants after every step."""
    results, step = {}, 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for args in arrivals.pop(step, []):
            engine.add_request(*args[:3], request_id=args[3])
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
        engine.check_invariants()
        step += 1
    assert engine.reserved_tokens == 0 and not engine.running
    return results


SPECS = [
    RequestSpec(drafter="ngram", k=4),
    RequestSpec(drafter="self", k=8),
    RequestSpec(drafter="random", k=2),
    RequestSpec(drafter="none"),
    RequestSpec(drafter="ngram", k=1),
    RequestSpec(drafter="self", policy="dspark", k=6),
    RequestSpec(drafter="ngram", policy="batch-table", k=8),
    RequestSpec(drafter="random", policy="dspark", k=3),
]


@pytest.mark.parametrize("policy", ["fixed", "batch-table", "dspark", "off"])
def test_greedy_equals_reference_in_any_batch(policy, target, other, plain):
    """A1 for the engine: staggered arrivals, mixed drafters and k, every policy; token-for-token equal."""
    engine = make_engine(target, other, policy=policy, k=4, drafter="ngram")
    arrivals: dict[int, list[tuple]] = {}
    for i, spec in enumerate(SPECS):
        p = i % len(PROMPTS)
        spec = RequestSpec(drafter=spec.drafter, k=spec.k) if policy != "fixed" else spec
        arrivals.setdefault(i // 2 * 3, []).append((PROMPTS[p], GREEDY, spec, f"r{i}"))
    results = run_checked(engine, arrivals)
    for i in range(len(SPECS)):
        assert results[f"r{i}"].token_ids == plain[i % len(PROMPTS)], f"request {i} ({SPECS[i]})"
    assert engine.metrics.num_drafts > 0 or policy == "off"


def test_self_draft_in_a_batch_accepts_everything(target, other, plain):
    """A2 inside a batch: drafting with the target itself is accepted at every position of every round."""
    engine = make_engine(target, other, policy="fixed", k=4, drafter="self")
    results = run_checked(engine, {0: [(p, GREEDY, RequestSpec(), f"r{i}") for i, p in enumerate(PROMPTS)]})
    for i in range(len(PROMPTS)):
        assert results[f"r{i}"].token_ids == plain[i]
    m = engine.metrics
    assert m.num_accepted_tokens == m.num_draft_tokens > 0


def test_corrupted_oracle_rounds_in_a_batch(target, plain):
    """Known per-round acceptance through the batched verifier: the oracle's corrupted position is the count."""
    oracle = CorruptedOracle(len(PROMPTS[0]), plain[0], target.config.vocab_size, pattern=[None, 0, 2, 1])
    engine = Engine(target, None, EngineConfig(k=4, drafter="oracle"), drafters={"oracle": oracle})
    results = run_checked(engine, {0: [(PROMPTS[0], GREEDY, RequestSpec(), "o"), (PROMPTS[1], GREEDY,
                                                                                   RequestSpec(drafter="ngram"), "n")]})
    assert results["o"].token_ids == plain[0]
    for (draft, accepted, _), bad in zip(oracle.rounds, [None, 0, 2, 1] * 10):
        assert accepted == (len(draft) if bad is None or bad >= len(draft) else bad)


def test_chunked_prefill_and_long_prompts(target, other, plain):
    """Prompts longer than the per-step prefill chunk are prefilled over several steps, next to decoding ones."""
    engine = make_engine(target, other, policy="fixed", k=4, drafter="ngram", prefill_chunk=5)
    results = run_checked(engine, {0: [(p, GREEDY, RequestSpec(), f"r{i}") for i, p in enumerate(PROMPTS)]})
    for i in range(len(PROMPTS)):
        assert results[f"r{i}"].token_ids == plain[i]


@pytest.mark.parametrize("drafter", ["random", "ngram", "none"])
def test_seeded_sampling_equals_reference(drafter, target, other):
    """A6: a seeded request draws exactly what the reference loop draws at the same k, next to other requests
    (seeded and unseeded) in the same batch."""
    params = [SamplingParams(max_tokens=20, temperature=t, top_k=tk, seed=s, ignore_eos=True)
              for t, tk, s in [(1.0, 0, 7), (0.7, 5, 11), (1.3, 0, 3)]]
    engine = make_engine(target, other, policy="fixed", k=3, drafter=drafter)
    arrivals = {i: [(PROMPTS[i], p, RequestSpec(), f"s{i}")] for i, p in enumerate(params)}
    arrivals[1].append((PROMPTS[3], SamplingParams(max_tokens=15, temperature=1.0), RequestSpec(), "unseeded"))
    arrivals[0].append((PROMPTS[4], GREEDY, RequestSpec(drafter="self"), "greedy"))
    results = run_checked(engine, arrivals)
    for i, p in enumerate(params):
        d = {"random": ModelDrafter(other), "ngram": None, "none": None}[drafter]
        if drafter == "ngram":
            from verispec.drafters import NgramDrafter

            d = NgramDrafter()
        ref = decode(target, PROMPTS[i], p, drafter=d, spec=SpecConfig(k=3 if d else 0))
        assert results[f"s{i}"].token_ids == ref.token_ids, f"seeded request {i}"


def test_aborts_free_everything(target, other, plain):
    """E3 for the engine: aborting a waiting, a running and an unknown request is safe and frees the cache at
    once; the others are unaffected."""
    engine = make_engine(target, other, policy="fixed", k=4, drafter="self", max_running=2)
    ids = [engine.add_request(p, GREEDY, RequestSpec(), f"r{i}") for i, p in enumerate(PROMPTS)]
    engine.step()
    engine.step()
    engine.abort("r0")  # running
    engine.abort("r4")  # waiting
    engine.abort("r4")  # twice: idempotent
    engine.abort("nope")
    outs = engine.step()
    aborted = {o.request_id for o in outs if o.result is not None and o.result.finish_reason == "abort"}
    assert aborted == {"r0", "r4"}
    results = run_checked(engine, {})
    for i in (1, 2, 3):
        assert results[ids[i]].token_ids == plain[i]
    assert engine.metrics.finished.get("abort") == 2


def test_admission_control(target, other, plain):
    """C2-style budget: requests wait until their cache fits, never exceed the budget, and get it all back;
    a request that can never fit and a full queue are refused with clear errors."""
    need = len(PROMPTS[0]) + GREEDY.max_tokens + 4 + 1
    engine = make_engine(target, other, policy="fixed", k=4, drafter="random", cache_budget_tokens=need + 10,
                         max_queued=3)
    with pytest.raises(ConfigError, match="cache budget"):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
    for i in range(3):
        engine.add_request(PROMPTS[i % 2], GREEDY, RequestSpec(), f"r{i}")
    with pytest.raises(QueueFull):
        engine.add_request(PROMPTS[0], GREEDY)
    max_running = 0
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
        engine.check_invariants()
        max_running = max(max_running, len(engine.running))
    assert max_running == 1  # two never fit together
    assert [results[f"r{i}"].token_ids for i in range(3)] == [plain[0], plain[1], plain[0]]
    assert engine.reserved_tokens == 0 and engine.metrics.rejected == 1


def test_forced_rejection_many_sequential_requests(target, other):
    """C2: an always-rejected drafter and a budget for about two requests, 40 sequential requests: all finish,
    nothing leaks."""
    engine = make_engine(target, other, policy="fixed", k=4, drafter="random", cache_budget_tokens=120)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for i in range(40):
        engine.add_request(PROMPTS[i % 3], params, RequestSpec(), f"r{i}")
    results = run_checked(engine, {})
    assert len(results) == 40 and all(len(r.token_ids) == 16 for r in results.values())


def test_stops_inside_the_batch(target, other, plain):
    """B1/B3: EOS mid-block and max_tokens exactness per request inside a batch with speculation."""
    eos = plain[0][5]
    engine = Engine(target, None, EngineConfig(k=4, drafter="self"), drafters={"self": ModelDrafter(target)})
    engine.eos = (eos,)
    reqs = {f"m{n}": (PROMPTS[0], SamplingParams(max_tokens=n, ignore_eos=True), RequestSpec(), f"m{n}")
            for n in (1, 2, 5, 9)}
    reqs["eos"] = (PROMPTS[0], SamplingParams(max_tokens=24), RequestSpec(), "eos")
    results = run_checked(engine, {0: list(reqs.values())})
    for n in (1, 2, 5, 9):
        assert results[f"m{n}"].token_ids == plain[0][:n] and results[f"m{n}"].finish_reason == "length"
    cut = plain[0].index(eos) + 1
    assert results["eos"].token_ids == plain[0][:cut] and results["eos"].stop_reason == eos


# ------------------------------------------------------------------------------------------------------------
# The dspark scheduler


def test_dspark_lengths_follow_survival_and_stop_early():
    """Positions are admitted in survival order while tau * SPS(B) grows; the first that does not stops it."""
    flat = lambda b: 1.0
    assert dspark_lengths([[0.9, 0.5], [0.8, 0.0]], 2, 2.0, flat) == [2, 1]
    steep = lambda b: 1.0 + 0.3 * (b - 2)
    # tau/time: base 2/1; +0.9 -> 2.9/1.3 = 2.23 (keep); +0.8 -> 3.7/1.6 = 2.31 (keep); +0.5 -> 4.2/1.9 = 2.21 stop
    assert dspark_lengths([[0.9, 0.5], [0.8, 0.1]], 2, 2.0, steep) == [1, 1]
    # Early stop, not a global argmax: a later, larger gain is never reached once one admission does not pay.
    jagged = {2: 1.0, 3: 1.5, 4: 1.5, 5: 1.5}
    assert dspark_lengths([[0.4, 0.4, 0.4]], 2, 2.0, lambda b: jagged[b]) == [0]


class _SlowConfidentDrafter(ModelDrafter):
    """The target drafting for itself, taking `delay` seconds a proposal and reporting confidence 1/2."""

    def __init__(self, target, delay: float) -> None:
        super().__init__(target)
        self.delay = delay

    def propose(self, requests):
        time.sleep(self.delay)
        return [Draft(d.tokens, d.probs, torch.full((len(d.tokens),), 0.5)) for d in super().propose(requests)]


def test_dspark_rule_counts_the_drafting_time(target, plain):
    """A step costs its drafting too: with tokens dear (50 ms a verified row) a half-sure position does not pay
    for itself on the target's time alone (1 token / 60 ms > 1.5 / 110 ms; the break-even is 40 ms of drafting),
    but once the drafter's 300 ms are part of every step it does (1 / 360 < 1.5 / 410), so the engine verifies
    drafts; outputs stay plain's either way."""
    bs = tuple(range(1, 17))
    dear = StepProfile({}, bs, tuple(0.01 + 0.05 * b for b in bs), 0.0, 0)
    for delay, verified in ((0.0, False), (0.3, True)):
        engine = Engine(target, None, EngineConfig(policy="dspark", k=4, drafter="slow"),
                        drafters={"slow": _SlowConfidentDrafter(target, delay)}, profile=dear)
        engine.add_request(PROMPTS[0], replace(GREEDY, max_tokens=6), request_id="r")
        out = engine.run_until_done()["r"]
        assert out.token_ids == plain[0][:6]
        assert (engine.metrics.num_draft_tokens > 0) == verified, delay


class _BudgetSpy(_SlowConfidentDrafter):
    """_SlowConfidentDrafter without the delay, recording each proposal's budget; `one_pass` as declared."""

    def __init__(self, target, one_pass: bool) -> None:
        super().__init__(target, 0.0)
        self.capabilities = replace(self.capabilities, one_pass=one_pass)
        self.budgets: list[int] = []

    def propose(self, requests):
        self.budgets += [r.budget for r in requests]
        return super().propose(requests)


def test_the_dspark_policy_asks_a_one_pass_drafter_for_k_every_round(target, plain):
    """With verified rows cheap but not free the dspark cut verifies part of a half-sure draft of 6. A drafter whose
    positions cost a forward each is then asked for two past what was verified next round; one that proposes them
    all in one forward (block drafters) for all 6 again. Outputs stay plain's."""
    bs = tuple(range(1, 17))
    cheap = StepProfile({}, bs, tuple(0.01 + 0.001 * b for b in bs), 0.0, 0)
    for one_pass in (False, True):
        spy = _BudgetSpy(target, one_pass)
        engine = Engine(target, None, EngineConfig(policy="dspark", k=6, drafter="spy"), drafters={"spy": spy},
                        profile=cheap)
        engine.add_request(PROMPTS[0], GREEDY, request_id="r")
        assert engine.run_until_done()["r"].token_ids == plain[0]
        early = spy.budgets[:3]
        assert len(early) == 3 and early[0] == 6, spy.budgets
        assert early == [6] * 3 if one_pass else max(early[1:]) < 6, (one_pass, spy.budgets)


def test_dspark_appendix_counterexample_is_lossless():
    """DSpark appendix A: p=(0.7,0.3), q=(0.5,0.5), SPS(1,2,3)=(1,0.5,0.45). A scheduler whose choice depends
    on the drafted token biases the output to (0.85, 0.15); ours decides from survival before the token, so the
    output of one round is exactly p whatever it decides."""
    p, q = np.array([0.7, 0.3]), np.array([0.5, 0.5])
    sps = {1: 1.0, 2: 0.5, 3: 0.45}
    length = dspark_lengths([[0.8]], 1, 1.0, lambda b: 1.0 / sps[b])[0]  # c = 0.8 is known before drawing x
    out = np.zeros(2)
    for x in range(2):  # draft x ~ q; verify if length == 1, else the target samples the token itself
        if length == 0:
            out += q[x] * p
            continue
        accept = min(1.0, p[x] / q[x])
        residual = np.maximum(p - q, 0)
        residual /= residual.sum()
        out[x] += q[x] * accept
        out += q[x] * (1 - accept) * residual
    np.testing.assert_allclose(out, p)


def test_acceptance_estimator_learns_per_position_rates():
    est = AcceptanceEstimator(max_k=4, prior=0.5, strength=2)
    for _ in range(200):
        est.update("d", "r", 4, 1)  # position 1 always accepted, position 2 never
    c = est.conditional("d", "r", 4)
    assert c[0] > 0.97 and c[1] < 0.03 and c[2] == pytest.approx(0.5)  # never reached: the prior
    assert est.conditional("d", "other", 4)[0] > 0.97  # a new request starts from the drafter's estimate
    assert survival([0.5, 0.5, 2.0]) == [0.5, 0.25, 0.25]


def test_acceptance_estimator_keeps_draft_kinds_apart():
    """Drafts of one drafter in different kinds (prompt lookup's 1- and 3-token matches) learn apart; drafts
    without a kind learn what they learnt before kinds existed; a finished request forgets every kind."""
    est, plain = AcceptanceEstimator(max_k=4, strength=2), AcceptanceEstimator(max_k=4, strength=2)
    for _ in range(100):
        est.update("d", "r", 4, 4, kind="n3")
        est.update("d", "r", 4, 0, kind="n1")
        est.update("d", "r", 4, 2)
        plain.update("d", "r", 4, 2)
    assert est.conditional("d", "r", 4, "n3")[0] > 0.97 and est.conditional("d", "r", 4, "n1")[0] < 0.03
    assert est.conditional("d", "new", 4, "n1")[0] < 0.03  # the drafter's estimate for that kind
    assert est.conditional("d", "r", 4, "n2") == [0.5] * 4  # a kind never seen: the prior
    assert est.conditional("d", "r", 4) == plain.conditional("d", "r", 4)
    est.forget("r")
    assert est.tracked() == [] and est.conditional("d", "r", 4, "n3") == est.conditional("d", "new", 4, "n3")


def test_profile_interpolates_and_measures(target):
    prof = StepProfile({}, (1, 4, 8), (1.0, 1.0, 2.0), 0.5, 0)
    assert prof.step_time(1) == 1.0 and prof.step_time(6) == pytest.approx(1.5)
    assert prof.step_time(12) == pytest.approx(3.0) and prof.step_time(4, requests=3) == pytest.approx(2.0)
    real = measure(target, token_counts=(1, 2, 4), context=8, repeats=1)
    assert len(real.seconds) == 3 and all(s > 0 for s in real.seconds) and real.key["dtype"] == "float32"
    assert StepProfile.from_json(real.to_json()) == real


# ------------------------------------------------------------------------------------------------------------
# Sampling through the dspark policy follows p (A5 through the engine)

N_STAT = 2000


@pytest.fixture(scope="module")
def stat_models():
    cfg = {"vocab_size": SV, "max_position_embeddings": 16, "num_hidden_layers": 1}
    return tiny_model(0, 0.25, **cfg), tiny_model(1, 0.25, **cfg)


def engine_samples(target, draft, n: int, policy: str) -> np.ndarray:
    """First three tokens of n seeded requests run 250 at a time through one engine."""
    # Free up to 500 tokens a step, steep after: of 250 requests x 3 drafts, dspark keeps about a third.
    profile = StepProfile({}, (1, 500, 501, 2000), (1.0, 1.0, 3.0, 10.0), 0.0, 0)
    engine = Engine(target, None, EngineConfig(k=3, policy=policy, drafter="d", max_running=250, max_queued=n),
                    drafters={"d": ModelDrafter(draft)}, profile=profile)
    for i in range(n):
        engine.add_request(S_PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=i), request_id=str(i))
    results = engine.run_until_done()
    lengths = engine.metrics.num_draft_tokens / max(engine.metrics.num_drafts, 1)
    assert policy != "dspark" or 0 < lengths < 3, "the dspark policy should cut some drafts and keep others"
    return np.array([results[str(i)].token_ids for i in range(n)])


@pytest.mark.parametrize("policy", ["dspark", "fixed"])
def test_engine_samples_from_target(policy, stat_models):
    target, draft = stat_models
    joints = exact_pair_joints(target, S_PROMPT, S_PARAMS)
    samples = engine_samples(target, draft, N_STAT, policy)
    limit = tv_limit(SV * SV, N_STAT)
    for cols, joint in (([0, 1], joints[0]), ([1, 2], joints[1])):
        tv, pval, impossible = check_pair(samples[:, cols], joint)
        assert tv < limit and pval > ALPHA and impossible == 0, (tv, limit, pval)


def test_engine_statistical_check_has_power(stat_models):
    """Negative control: the draft model's own samples (what an always-accept engine would emit) fail it."""
    target, draft = stat_models
    joints = exact_pair_joints(target, S_PROMPT, S_PARAMS)
    engine = Engine(draft, None, EngineConfig(k=0, drafter=None, max_running=250, max_queued=N_STAT))
    for i in range(N_STAT):
        engine.add_request(S_PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=i), request_id=str(i))
    results = engine.run_until_done()
    samples = np.array([results[str(i)].token_ids for i in range(N_STAT)])
    tv, pval, _ = check_pair(samples[:, [0, 1]], joints[0])
    assert tv >= tv_limit(SV * SV, N_STAT) or pval <= ALPHA


def test_bad_requests_are_refused_before_queueing(target, other):
    engine = make_engine(target, other)
    with pytest.raises(ConfigError, match="empty"):
        engine.add_request([])
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        engine.add_request([10**6])
    with pytest.raises(ConfigError, match="unknown drafter"):
        engine.add_request([1, 2], GREEDY, RequestSpec(drafter="nope"))
    with pytest.raises(ConfigError, match="context limit"):
        engine.add_request(list(range(1, 90)) * 2)
    assert not engine.has_unfinished()
    assert torch.is_grad_enabled()  # steps run under inference_mode; nothing leaks out
