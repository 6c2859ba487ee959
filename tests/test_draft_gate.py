"""engine.gate.DraftGate: steps under the dspark policy draft only at loads where drafting has paid."""

from __future__ import annotations

import math

import pytest
from conftest import tiny_model

from verispec.config import EngineConfig, RequestSpec, SamplingParams
from verispec.decode import decode
from verispec.drafters import ModelDrafter
from verispec.drafters.base import EMPTY_DRAFT
from verispec.engine.engine import Engine
from verispec.engine.gate import DraftGate


def warmed(requests: int, **kw) -> DraftGate:
    """A gate that has seen each choice's warm-up step at this load (not counted: see record)."""
    g = DraftGate(**kw)
    for drafted in (True, False):
        g.record(requests, drafted, tokens=1, seconds=1.0)
    assert g.rates == {}
    return g


def test_gate_measures_both_then_follows_the_faster_and_probes_the_other():
    g = warmed(8, probe_every=4, probe_cost=1.0)  # probes as often as probe_every allows
    assert g.draft(8) is True  # nothing measured at this load: draft first
    g.record(8, True, tokens=8, seconds=0.010)  # drafting: 800 tokens/s
    assert g.draft(9) is False  # same bucket (8-15): now measure a plain step
    g.record(9, False, tokens=9, seconds=0.006)  # plain: 1,500 tokens/s
    picks = [g.draft(12) for _ in range(8)]
    assert picks.count(True) == 2 and picks[1] is True and picks[5] is True  # every 4th decision probes drafting
    assert g.draft(1) is False  # an unmeasured load starts with the nearest measured one's verdict: plain
    for _ in range(20):  # the text turns easy: drafting pays again and the probes see it
        g.record(10, True, tokens=40, seconds=0.012)
    assert g.draft(10) is True


def test_a_much_slower_choice_is_probed_rarely():
    """Probing costs at most probe_cost of the time: a choice 3x slower is retried every 80 steps, not every 16 (a
    probe of drafting from plain is two drafted steps: the first drafts cold and is not counted)."""
    g = warmed(32, probe_every=16, probe_cost=0.05, trust=1)
    g.record(32, True, tokens=32, seconds=0.030)  # drafting: 1,067 tokens/s
    g.record(32, False, tokens=32, seconds=0.010)  # plain: 3,200 tokens/s, 3x faster
    picks = [g.draft(40) for _ in range(160)]
    assert [i + 1 for i, p in enumerate(picks) if p] == [80, 160]


def test_steps_that_prefill_take_the_better_known_choice_and_are_not_probes():
    g = warmed(4, probe_every=2, probe_cost=1.0)
    assert g.draft(4, clean=False) is False  # nothing known: plain while the prompt is being prefilled
    g.record(4, True, tokens=12, seconds=0.010)
    assert g.draft(4, clean=False) is False  # plain still unmeasured
    g.record(4, False, tokens=4, seconds=0.010)
    assert [g.draft(5, clean=False) for _ in range(4)] == [True] * 4  # drafting is better; no probes
    assert g.steps == {}  # only clean steps count toward the probe schedule


def test_the_first_step_of_each_choice_is_a_warm_up():
    """A load's first drafted step pays one-off costs (17-28 ms against ~4.5 on the zoo's DSpark drafter): counted, it
    kept the gate off drafting for hundreds of steps at one request."""
    g = DraftGate(probe_every=16, probe_cost=0.05)
    assert g.draft(1) is True
    g.record(1, True, tokens=2, seconds=0.028)  # the cold first drafted step: not counted
    assert g.draft(1) is True  # still unmeasured: draft again
    g.record(1, True, tokens=4, seconds=0.0045)
    for _ in range(2):  # plain's own warm-up, then its measurement
        assert g.draft(1) is False
        g.record(1, False, tokens=1, seconds=0.002)
    picks = [g.draft(1) for _ in range(32)]  # drafting, with plain probed every 16th decision
    assert picks.count(False) == 2


def test_rates_are_averaged_tokens_over_averaged_time():
    """A run of short drafted rounds moves the rate by what they weigh in tokens and time, not by their rates."""
    g = warmed(1, decay=0.5)
    g.record(1, True, tokens=8, seconds=0.004)
    g.record(1, True, tokens=1, seconds=0.004)
    assert abs(g.rates[(1, True)] - 4.5 / 0.004) < 1e-6  # (0.5 * 8 + 0.5 * 1) / 0.004


def test_gate_ignores_steps_without_time():
    g = DraftGate()
    g.record(4, True, tokens=3, seconds=0.0)
    assert g.rates == {}


def test_engine_skips_drafting_where_it_does_not_pay_and_outputs_stay_plain():
    """A drafter that costs more than it saves (an unrelated model's k forwards a step, its drafts nearly always
    rejected): after the gate has measured both choices it mostly stops drafting, counts the steps it skipped, and
    every output equals plain decoding. (Decided on wall time, but by a wide margin: a drafted step runs four more
    forwards and verifies five rows per request to commit about what a plain step commits.)"""
    target = tiny_model(4)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [list(range(3 + i, 23 + i)) for i in range(3)]
    plain = [decode(target, p, params).token_ids for p in prompts]
    engine = Engine(target, None, EngineConfig(policy="dspark", k=4, drafter="random"),
                    drafters={"random": ModelDrafter(tiny_model(5))})
    for i, p in enumerate(prompts):
        engine.add_request(p, params, RequestSpec(), request_id=str(i))
    results = engine.run_until_done()
    assert [results[str(i)].token_ids for i in range(3)] == plain
    assert engine.metrics.undrafted_steps > engine.metrics.num_steps // 2


def test_probe_spacing_weighs_a_probes_time_beyond_the_better_choice():
    """A drafted step that commits many more tokens than a plain one is not charged as the ratio of the rates: a
    probe costs the time it takes beyond what plain steps take for the same tokens (at 64 requests, Zen 5: 173 ms
    for ~190 tokens against plain's 55 in 23 ms; spacing by the rates' ratio probed every 24 steps, which let 7% of
    the steps take 19% of the time). A probe of drafting from plain is two such steps (the first drafts cold)."""
    g = warmed(64, probe_every=16, probe_cost=0.05, trust=1)
    g.record(64, True, tokens=190, seconds=0.173)
    g.record(64, False, tokens=55, seconds=0.023)
    loss = 2 * (0.173 - 190 * 0.023 / 55)  # twice 93.5 ms beyond plain for the same tokens
    assert g.spacing(g.bucket(64)) == math.ceil(loss / (0.05 * 0.023)) == 163
    picks = [g.draft(64) for _ in range(326)]
    assert [i + 1 for i, p in enumerate(picks) if p] == [163, 326]


def test_a_heavier_load_never_drafts_while_a_lighter_one_finds_drafting_slower():
    """Drafting pays less the more requests share a step: above a load where it measured slower, steps do not draft,
    not even to probe, until that load's own probes find drafting faster again."""
    g = warmed(8, probe_every=4, probe_cost=0.05, decay=0.5, trust=1)
    g.record(8, True, tokens=16, seconds=0.030)  # drafting at 8-15 requests: 533 tokens/s
    g.record(8, False, tokens=8, seconds=0.008)  # plain: 1,000 tokens/s
    every = g.spacing(g.bucket(8))
    assert every > 4
    picks = []
    for _ in range(4 * every):  # 16-31 requests: plain throughout
        picks.append(g.draft(20))
        if not picks[-1]:
            g.record(20, False, tokens=20, seconds=0.015)
    assert not any(picks) and g.draft(20, clean=False) is False
    assert [g.draft(8) for _ in range(every)][-1] is True  # the lighter load still probes at its spacing
    for _ in range(3):
        g.record(8, True, tokens=60, seconds=0.010)  # ... and finds drafting faster now
    assert g.draft(20) is True  # the heavier load measures drafting again (nearest load: it pays)



def test_a_lighter_load_where_drafting_ties_plain_bounds_no_heavier_one():
    """Only a lighter load where drafting measured slower keeps heavier ones plain: one where it is merely short of
    the margin (a tie) leaves a heavier load to its own averages."""
    g = warmed(1, probe_every=4, probe_cost=0.05, trust=1)
    g.record(1, True, tokens=3, seconds=0.0048)  # drafting at one request: 625 tokens/s
    g.record(1, False, tokens=1, seconds=0.00163)  # plain: 613 tokens/s (drafting 1.02x: plain is chosen there)
    assert g.draft(1) is False
    for drafted in (True, False):  # 2-3 requests: drafting 1,480 tokens/s against plain's 1,080
        g.record(2, drafted, 1, 1.0)  # the warm-up steps
        g.record(2, drafted, 9 if drafted else 2, 0.0061 if drafted else 0.00185)
    assert g.draft(2) is True
    for _ in range(60):  # one request turns slower drafting than plain: heavier loads stay plain
        g.record(1, True, tokens=2, seconds=0.0048)
    assert g.rates[(1, True)] < g.rates[(1, False)]
    assert not any(g.draft(2) for _ in range(40))

def test_an_average_of_few_samples_is_probed_often_and_bounds_no_heavier_load():
    """One slow early drafted step (a drafter's first shapes) must not decide a load: until each choice has `trust`
    samples the other is retried every probe_every steps, and the load does not keep heavier ones plain."""
    def gate(trust: int) -> DraftGate:
        g = warmed(1, probe_every=4, probe_cost=0.02, trust=trust)
        g.record(1, True, tokens=2, seconds=0.012)  # drafting's first counted step: 167 tokens/s
        for _ in range(5):
            g.record(1, False, tokens=1, seconds=0.002)  # plain: 500 tokens/s
        for drafted in (True, False):  # 16-31 requests: drafting measured faster there
            for tokens, seconds in ((1, 1.0), (80, 0.020), (80, 0.020), (80, 0.020)):  # a warm-up, then 4,000 tok/s
                g.record(20, drafted, tokens if drafted else 20, seconds if drafted else 0.010)
        return g

    assert gate(trust=1).draft(20) is False  # trusted, the lighter load's verdict keeps heavier ones plain
    g = gate(trust=3)
    assert g.draft(20) is True  # one sample bounds nothing: the heavier load follows its own averages
    assert g.spacing(g.bucket(1)) > 12  # trusted, this average would be retried every 25 steps, not every 4
    picks = []
    for _ in range(12):
        picks.append(g.draft(1))
        if picks[-1]:
            g.record(1, True, tokens=5, seconds=0.004)  # drafting really makes 1,250 tokens/s
        else:
            g.record(1, False, tokens=1, seconds=0.002)
    assert picks[:4] == [False, False, False, True]  # retried at probe_every...
    assert picks[7:11] == [True] * 4  # ... until its average (the first samples weigh alike) shows it pays


def test_a_heavier_load_measures_drafting_first_where_a_lighter_one_found_it_faster():
    g = warmed(8)
    g.record(8, True, tokens=40, seconds=0.010)
    g.record(8, False, tokens=8, seconds=0.008)
    assert g.draft(20) is True


def test_a_probe_refreshes_an_estimate_that_has_aged():
    """The choice not taken is seen only at probes; its estimate ages with the steps recorded at its load, so one slow
    first step does not decide the load for the rest of the run."""
    g = warmed(8, probe_every=16, probe_cost=0.05, decay=0.9)
    g.record(8, True, tokens=16, seconds=0.020)  # drafting: 800 tokens/s
    g.record(8, False, tokens=8, seconds=0.014)  # plain's first step, slow: 571 tokens/s (it is 2,000)
    probes = 0
    for _ in range(64):
        if g.draft(8):
            g.record(8, True, tokens=16, seconds=0.020)
        else:
            probes += 1
            g.record(8, False, tokens=8, seconds=0.004)
        b = g.bucket(8)
        if g.rates[(b, False)] > g.rates[(b, True)]:
            break
    assert probes <= 2  # the first two plain probes find it faster
    fresh = warmed(8, decay=0.9, trust=1)
    fresh.record(8, True, tokens=16, seconds=0.020)
    fresh.record(8, True, tokens=0, seconds=0.020)  # a choice seen every step keeps the plain decay
    assert abs(fresh.sums[(fresh.bucket(8), True)][0] - 0.9 * 16) < 1e-9


def test_one_stalled_step_does_not_flip_the_choice():
    """A step that stalls (a 207 ms plain step among 12 ms ones, 32 requests through the server) counts as at most
    `clip` average steps: counted whole, it makes plain's average 2.5x slower, enough to flip the choice."""
    g = warmed(32, clip=2.0)
    g.record(32, True, tokens=100, seconds=0.080)  # drafting: 1,250 tokens/s
    for _ in range(10):
        g.record(32, False, tokens=32, seconds=0.012)  # plain: 2,667 tokens/s
    g.record(32, False, tokens=32, seconds=0.207)
    assert g.rates[(g.bucket(32), False)] > 2000
    assert g.draft(32) is False


def test_a_load_between_takes_the_nearest_measured_loads_verdict():
    """A closed loop's tail drains through lighter loads: one next to a load where drafting lost starts plain even
    where a much lighter load found drafting faster."""
    g = DraftGate(probe_every=4, probe_cost=0.05)
    for n, drafted, tokens, seconds in ((1, True, 5, 0.005), (1, False, 1, 0.002),  # 1 request: drafting pays
                                        (20, True, 60, 0.080), (20, False, 20, 0.010)):  # 16-31: it does not
        g.record(n, drafted, tokens, seconds)  # the warm-ups
        g.record(n, drafted, tokens, seconds)
    assert g.draft(12) is False  # 8-15 requests: nearest is 16-31 (drafting slower): plain first
    assert g.draft(2) is True  # 2-3 requests: nearest is 1 (drafting faster): measure drafting first
    assert g.draft(4) is False  # 4-7: equally near 1 and 16-31 (via 2-3, unmeasured): the heavier one's verdict


def test_drafting_must_beat_plain_by_the_margin():
    g = warmed(8, margin=1.1, decay=0.9)
    g.record(8, True, tokens=21, seconds=0.020)  # 1,050 tokens/s
    g.record(8, False, tokens=10, seconds=0.010)  # 1,000 tokens/s: drafting 5% faster, inside the margin
    assert g.draft(8) is False and g.draft(8, clean=False) is False
    g.record(8, True, tokens=40, seconds=0.020)  # now well ahead
    assert g.draft(8) is True


def _block_drafter(target, window: int):
    import torch

    from verispec.drafters.block import BlockDrafter
    from verispec.model.block import BlockConfig, BlockDraftModel

    torch.manual_seed(0)
    model = BlockDraftModel(target.config, BlockConfig(target_layers=(1,), block_size=4, num_layers=1, head="markov",
                                                      markov_rank=8, confidence=True))
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            torch.nn.init.normal_(p, std=0.2)
    return BlockDrafter(model.eval(), target, context_window=window)


def test_while_the_gate_keeps_plain_a_windowed_drafter_gets_no_rows_and_resumes_on_the_kept_anchor_rows():
    """Steps the gate keeps plain hand a drafter whose context may have gaps (a windowed block drafter) no hidden
    rows; when drafting resumes it is handed the latest RESUME_ROWS anchors' rows (its context restarts at the first
    of them after a longer stretch, and goes on without a gap after a shorter one), and every output equals plain
    decoding. A drafter without gaps (the whole context) is handed every round's rows as before."""
    target = tiny_model(4)
    keep = Engine.RESUME_ROWS
    params = SamplingParams(max_tokens=2 * keep + 48, ignore_eos=True)  # none can finish within the script
    prompts = [list(range(3 + i, 23 + i)) for i in range(3)]
    plain = [decode(target, p, params).token_ids for p in prompts]
    for window, gaps in ((4, True), (0, False)):
        drafter = _block_drafter(target, window)
        assert drafter.capabilities.context_gaps is gaps
        accepted, observed = [], []
        accept, observe = drafter.accept, drafter.observe
        drafter.accept = lambda r: accepted.append(r.seq_id) or accept(r)
        drafter.observe = lambda sid, start, h: observed.append(
            (start, drafter.context_length(sid), next(iter(h.values())).shape[0])) or observe(sid, start, h)
        engine = Engine(target, None, EngineConfig(policy="dspark", k=4, drafter="block"), drafters={"block": drafter})
        # drafting; a stretch of plain steps longer than the rows kept; drafting; a shorter one; then drafting
        script = iter([True, True] + [False] * (keep + 3) + [True] * 3 + [False] * 4)
        engine.gate.draft = lambda n, clean=True, peak=None: next(script, True)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, RequestSpec(), request_id=str(i))
        results = engine.run_until_done()
        assert [results[str(i)].token_ids for i in range(3)] == plain
        assert engine.metrics.undrafted_steps == keep + 7
        resumed = [(start - known, n) for start, known, n in observed[3:]]  # after the three prompts
        if gaps:  # the plain steps handed nothing; each stretch's kept anchor rows came when drafting resumed: past
            # the 3 oldest of the long one (its context restarts), right where the context ended after the short one
            assert len(accepted) == engine.metrics.num_rounds - (keep + 7) * 3
            assert resumed == [(3, keep)] * 3 + [(0, 4)] * 3
        else:
            assert len(accepted) == engine.metrics.num_rounds and not resumed
        assert not drafter.live_sequences()


def test_a_block_drafter_restarts_its_context_at_a_gap_only_when_windowed():
    import pytest
    import torch

    target = tiny_model(4)
    for window in (4, 0):
        drafter = _block_drafter(target, window)
        drafter.start(0, list(range(3, 13)))
        drafter.observe(0, 0, {1: torch.randn(9, target.config.hidden_size)})
        if not window:
            with pytest.raises(ValueError, match="new rows start at 12"):
                drafter.observe(0, 12, {1: torch.randn(1, target.config.hidden_size)})
            continue
        drafter.observe(0, 12, {1: torch.randn(1, target.config.hidden_size)})
        assert drafter.context_length(0) == 13 and drafter._ctx_start[0] == 12
        with pytest.raises(ValueError, match="new rows start at 5"):  # never backwards
            drafter.observe(0, 5, {1: torch.randn(1, target.config.hidden_size)})


def test_the_gate_times_the_whole_step_cache_growth_included(monkeypatch):
    """A step's recorded time starts before the caches grow for the next round: that growth is part of what the
    step's tokens cost (timed from the drafting on, a drafted step's rate read 5% high at 4 requests, Zen 5)."""
    import verispec.engine.engine as engine_module

    clock = [0.0]

    def perf_counter() -> float:
        clock[0] += 1e-6
        return clock[0]

    monkeypatch.setattr(engine_module.time, "perf_counter", perf_counter)
    engine = Engine(tiny_model(4), None, EngineConfig(policy="dspark", k=4, drafter="d", kv_block=8),
                    drafters={"d": ModelDrafter(tiny_model(5))})
    grow, grows, recorded = engine._grow, [], []

    def slow_grow() -> None:
        clock[0] += 1.0  # one second per growth phase: every recorded step must carry it
        grows.append(1)
        grow()

    record = engine.gate.record
    monkeypatch.setattr(engine, "_grow", slow_grow)
    monkeypatch.setattr(engine.gate, "record",
                        lambda r, d, t, s, counted=True, expected=None: (recorded.append(s),
                                                                         record(r, d, t, s, counted, expected)))
    engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=24, ignore_eos=True), RequestSpec())
    engine.run_until_done()
    assert len(recorded) >= 5 and len(grows) == engine.metrics.num_steps
    assert all(1.0 <= s < 1.1 for s in recorded), recorded


def test_probes_that_confirm_the_choice_back_off_and_a_flip_resets_them():
    """Each probe that finds the other choice still worse doubles its load's spacing (up to max_backoff); one that
    flips the choice brings the spacing back, so a changed load is still found."""
    g = warmed(32, probe_every=16, probe_cost=0.05, trust=1, max_backoff=4)
    g.record(32, True, tokens=32, seconds=0.030)  # drafting: 1,067 tokens/s
    g.record(32, False, tokens=32, seconds=0.010)  # plain: 3,200 tokens/s
    assert g.spacing(g.bucket(32)) == 80
    probes = []
    for i in range(1, 1601):
        if g.draft(40):
            probes.append(i)
            g.record(40, True, tokens=32, seconds=0.030)  # each probe confirms: drafting still slower
        else:
            g.record(40, False, tokens=32, seconds=0.010)
    # spacings 80, 160, 320, then capped at 320: probes at multiples of the spacing in force
    assert probes[:4] == [80, 160, 320, 640] and all(b - a == 320 for a, b in zip(probes[2:], probes[3:]))
    assert g.backoff[g.bucket(32)] == 4
    for _ in range(50):  # the text turns easy: drafting pays again; the probe that flips the choice resets it
        g.record(40, True, tokens=200, seconds=0.030)
        if g.rates[(g.bucket(32), True)] > 1.1 * g.rates[(g.bucket(32), False)]:
            break
    assert g.draft(40) is True and g.backoff[g.bucket(32)] == 1


def test_without_backoff_the_spacing_stays_put():
    g = warmed(32, probe_every=16, probe_cost=0.05, trust=1, max_backoff=1)
    g.record(32, True, tokens=32, seconds=0.030)
    g.record(32, False, tokens=32, seconds=0.010)
    probes = []
    for i in range(1, 201):
        if g.draft(40):
            probes.append(i)
            g.record(40, True, tokens=32, seconds=0.030)
        else:
            g.record(40, False, tokens=32, seconds=0.010)
    assert probes == [80, 160]


def test_steps_kept_plain_by_a_lighter_load_are_not_probes():
    """A heavier load held plain because a lighter one found drafting slower records plain steps where drafting is
    its own better choice: those are no probes, and must not back its spacing off."""
    g = warmed(1, probe_every=4, probe_cost=0.05, trust=1)
    g.record(1, True, tokens=2, seconds=0.010)  # one request: drafting 200 tokens/s
    g.record(1, False, tokens=1, seconds=0.002)  # plain 500
    for drafted in (True, False):
        g.record(8, drafted, 1, 1.0)  # 8-15 requests: the warm-ups
    g.record(8, True, tokens=40, seconds=0.010)  # drafting 4,000 tokens/s
    g.record(8, False, tokens=8, seconds=0.008)  # plain 1,000
    for _ in range(50):
        assert g.draft(8) is False  # kept plain by the lighter load's verdict
        g.record(8, False, tokens=8, seconds=0.008)
    assert g.backoff.get(g.bucket(8), 1) == 1


def test_a_flip_by_the_chosen_choices_own_steps_resets_the_backoff():
    """The spacing backs off while probes confirm plain; when plain's own steps slow down until drafting is the
    better choice, plain (now the other choice) is probed at the plain spacing again, not the backed-off one."""
    g = warmed(32, probe_every=16, probe_cost=0.05, trust=1, max_backoff=4)
    g.record(32, True, tokens=32, seconds=0.030)
    g.record(32, False, tokens=32, seconds=0.010)
    for _ in range(400):
        if g.draft(40):
            g.record(40, True, tokens=32, seconds=0.030)
        else:
            g.record(40, False, tokens=32, seconds=0.010)
    b = g.bucket(32)
    assert g.backoff[b] == 4
    for _ in range(300):  # plain slows down (its steps are recorded as they come)
        g.record(40, False, tokens=32, seconds=0.100)
        if g.rates[(b, True)] >= 1.1 * g.rates[(b, False)]:
            break
    assert g.draft(40) is True and g.backoff[b] == 1


def test_a_gate_that_trusts_one_sample_records_a_first_step_of_each_choice():
    g = DraftGate(trust=0)
    for drafted in (True, False):
        g.record(4, drafted, 1, 1.0)  # warm-ups
    g.record(4, True, tokens=12, seconds=0.010)  # the other choice has no average yet: no verdict to compare
    g.record(4, False, tokens=4, seconds=0.010)
    assert set(g.rates) == {(3, True), (3, False)}


def test_a_step_that_drafts_cold_is_not_counted_and_its_choice_is_taken_again():
    """A drafted step where some drafter builds its context anew (a request's first drafted round, or its first after
    plain steps) is not measured: the averages stay as they were and the next clean step at that load drafts again,
    still the probe it was (its confirmation backs the spacing off). At most max_redo such steps in a row."""
    g = warmed(4, probe_every=4, probe_cost=10.0, trust=1, max_redo=2)  # probes every 4th decision
    g.record(4, True, tokens=8, seconds=0.010)  # drafting: 800 tokens/s
    g.record(4, False, tokens=4, seconds=0.002)  # plain: 2,000 tokens/s
    b = g.bucket(4)
    before = dict(g.sums)
    picks = [g.draft(5) for _ in range(3)]
    assert picks == [False] * 3
    assert g.draft(5) is True  # the fourth decision probes drafting
    g.record(5, True, tokens=1, seconds=0.050, counted=False)  # it drafted cold: not measured
    assert g.sums == before and g.samples[(b, True)] == 1
    assert g.draft(4, clean=False) is False  # a prefilling step between: the better choice
    assert g.draft(5) is True  # the next clean step drafts again, a probe still
    g.record(5, True, tokens=8, seconds=0.010)  # warm: drafting still slower, so the probe backs the spacing off
    assert g.backoff[b] == 2 and g.samples[(b, True)] == 2  # counted this time
    for _ in range(2):  # decisions 6 and 7 (the redone step counted as the fifth)
        assert g.draft(6) is False
        g.record(6, False, tokens=6, seconds=0.003)
    assert g.draft(6) is True  # the next probe: decision 8, at twice the spacing
    for _ in range(3):  # a new request drafting cold in every step: the choice is retried twice, then given up
        g.record(6, True, tokens=1, seconds=0.050, counted=False)
        if not g.draft(6):
            break
    assert g.unmeasured[b] == 3 and b not in g.redo
    assert g.draft(6) is False


def test_the_engine_counts_no_step_where_a_drafter_proposed_cold():
    """A request's first drafted round after a plain step is handed to the gate as not counted (its drafter's
    context is behind); rounds after a drafted one are counted; a step whose request has no draft budget left (its
    last token) is a plain step to the gate, whatever it decided."""
    target = tiny_model(4)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = Engine(target, None, EngineConfig(policy="dspark", k=4, drafter="d"),
                    drafters={"d": ModelDrafter(tiny_model(5))})  # an unrelated model: rounds of about one token
    script = iter([True, True, True, False])  # then True; the first decision is the prefilling step's
    engine.gate.draft = lambda n, clean=True, peak=None: next(script, True)
    calls = []
    engine.gate.record = lambda r, d, t, s, counted=True, expected=None: calls.append((d, counted))
    engine.add_request(list(range(3, 23)), params, RequestSpec())
    out = engine.run_until_done()
    assert len(next(iter(out.values())).token_ids) == 16
    # the prefilling step drafted (a draft model reads no prompt rows) and is not recorded: warm, warm, plain,
    # cold (after the plain step), warm ..., and the last token's step plain
    assert calls[:5] == [(True, True), (True, True), (False, True), (True, False), (True, True)]
    assert set(calls[5:-1]) == {(True, True)} and calls[-1] == (False, True)


def test_a_round_that_proposed_nothing_leaves_the_next_one_warm():
    """Cold means asked to propose after a step that did not ask (the drafter has tokens to catch up), not after a
    round that proposed nothing: prompt lookup finds no match on many steps and has nothing to catch up, and counted
    as cold every step after such a round went unmeasured (the gate then stopped learning at that load)."""

    class Sometimes(ModelDrafter):  # proposes nothing on every other call, as a lookup without a match does
        calls = 0

        def propose(self, requests):
            self.calls += 1
            return super().propose(requests) if self.calls % 2 else [EMPTY_DRAFT] * len(requests)

    engine = Engine(tiny_model(4), None, EngineConfig(policy="dspark", k=4, drafter="d"),
                    drafters={"d": Sometimes(tiny_model(5))})
    engine.gate.draft = lambda n, clean=True, peak=None: True
    calls = []
    engine.gate.record = lambda r, d, t, s, counted=True, expected=None: calls.append((d, counted))
    engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=16, ignore_eos=True), RequestSpec())
    out = engine.run_until_done()
    assert len(next(iter(out.values())).token_ids) == 16
    assert {d for d, _ in calls} == {True, False}  # rounds with and without draft tokens
    assert all(counted for _, counted in calls), calls


def test_a_request_under_another_policy_catching_up_on_its_prompt_leaves_the_step_unmeasured():
    """A fixed-policy request whose drafter reads the prompt's hidden states proposes for the first time in the step
    after its prompt: that proposal catches up on the prompt, so the step is not measured even though the request
    is not the gate's (the dspark request beside it drafts warm)."""
    target = tiny_model(4)
    engine = Engine(target, None, EngineConfig(policy="dspark", k=4, drafter="d"),
                    drafters={"d": _block_drafter(target, 0)})
    engine.gate.draft = lambda n, clean=True, peak=None: True
    calls = []
    engine.gate.record = lambda r, d, t, s, counted=True, expected=None: calls.append(counted)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request(list(range(3, 23)), params, RequestSpec(), request_id="a")
    for _ in range(4):  # "a" prefills, then drafts: cold once, then warm
        engine.step()
    assert calls[-1] is True
    before = len(calls)
    engine.add_request(list(range(30, 50)), params, RequestSpec(policy="fixed"), request_id="b")
    engine.step()  # b's prompt rides along: not a clean step, not recorded
    assert len(calls) == before
    engine.step()  # b proposes for the first time, catching up on its prompt
    assert calls[before:] == [False]
    engine.run_until_done()
    assert calls[-1] is True



def test_peak_is_the_most_requests_of_the_recent_steps():
    g = DraftGate(window=3)
    assert [g.peak(n) for n in (4, 3, 3, 3, 1, 2)] == [4, 4, 4, 3, 3, 3]
    assert [DraftGate(window=1).peak(n) for n in (4, 3, 1)] == [4, 3, 1]


def test_a_step_below_a_recent_load_where_drafting_does_not_pay_stays_plain():
    """A client between two requests leaves a few steps one request short (3 of 4): where drafting pays at 2-3
    requests but not at 4-7, those steps stay plain; where it pays at both, or the peak is unmeasured, they draft.
    A step held plain so is not recorded; the others are, at their own count."""
    g = DraftGate(probe_every=1000, probe_cost=1e-6)
    for b_req, drafted, tokens in ((2, True, 6), (2, False, 2), (4, True, 8), (4, False, 4)):
        for _ in range(g.trust + 1):  # the warm-up step, then trusted averages
            g.record(b_req, drafted, tokens, 0.004)  # 2-3 requests: drafting 3x plain; 4-7: 2x plain
    assert g.draft(3, peak=4) is True and g.draft(3, peak=9) is True  # 8-15 unmeasured: no bound
    for _ in range(150):  # (each step counts at most `clip` times the average: the average climbs gradually)
        g.record(4, True, tokens=8, seconds=0.016)  # drafting turns slower at 4-7 (500 tok/s against 1,000)
    assert g.draft(3) is True and g.draft(3, peak=4) is False and g.draft(3, peak=3) is True
    assert g.draft(3, clean=False, peak=4) is False  # a prefilling step too
    assert g.draft(3, peak=4) is False
    g.record(3, False, tokens=3, seconds=0.004)
    assert g.samples[(2, False)] == g.trust  # held plain: not recorded
    assert g.draft(3, peak=3) is True
    g.record(3, True, tokens=9, seconds=0.004)
    assert g.samples[(2, True)] == g.trust + 1  # (the first sample of each choice was the warm-up)


def test_a_probe_held_plain_by_the_peak_is_no_probe():
    g = DraftGate(probe_every=2, probe_cost=1.0)
    for b_req, drafted, tokens in ((2, True, 2), (2, False, 3), (4, True, 2), (4, False, 8)):
        for _ in range(g.trust + 1):
            g.record(b_req, drafted, tokens, 0.004)  # plain pays at both loads: drafting is the probe
    picks = []
    for _ in range(6):
        picks.append(g.draft(3, peak=4))
        assert 2 not in g.probing  # a probe of drafting held plain leaves none pending
        g.record(3, False, tokens=3, seconds=0.004)
    assert picks == [False] * 6 and g.backoff.get(2, 1) == 1  # so no probe backs the spacing off
    assert g.draft(3, peak=3) is False  # the verdict at 2-3 is plain: no hold, a step recorded as ever
    g.record(3, False, tokens=3, seconds=0.004)
    assert g.samples[(2, False)] == g.trust + 3 + 1  # the plain decisions between the three held probes, and this


def test_the_engine_hands_the_gate_each_steps_own_count_and_the_recent_peak():
    """The peak counts prefilling requests too (a returning client is load already) and looks back `window` steps;
    draft and record get the step's own decoding count."""
    target = tiny_model(4)
    engine = Engine(target, None, EngineConfig(policy="dspark", k=4, drafter="d"),
                    drafters={"d": ModelDrafter(tiny_model(5))})
    engine.gate.window = 4
    raw, calls, records = [], [], []
    peak, draft, record = engine.gate.peak, engine.gate.draft, engine.gate.record
    engine.gate.peak = lambda n: raw.append(n) or peak(n)
    engine.gate.draft = lambda n, clean=True, p=None: calls.append((n, p)) or draft(n, clean, p)
    engine.gate.record = lambda n, *a, **k: records.append(n) or record(n, *a, **k)
    engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=3, ignore_eos=True), RequestSpec())
    engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=30, ignore_eos=True), RequestSpec())
    engine.run_until_done()
    assert raw[0] == 2 and 1 in raw[:4]  # the short request is done within a few steps
    assert [p for _, p in calls] == [max(raw[max(0, i - 3) : i + 1]) for i in range(len(raw))]
    assert [n for n, _ in calls] == raw  # no prompt waits here: the decoding count is the step's count
    assert set(records) <= {1, 2} and records[-1] == 1


def test_drafted_steps_average_expected_tokens_scaled_by_the_calibration():
    """Where the engine gives a drafted step's expected tokens, its load averages those (steadier than the tokens
    committed, which follow each round's luck) and reads them through the calibration: what drafted steps at every
    load committed per token expected."""
    g = warmed(1, decay=0.5)
    for committed in (1, 9, 1, 9):  # luck around an expectation of 4: committed averages 5, expected 4
        g.record(1, True, tokens=committed, seconds=0.004, expected=4.0)
    assert g.sums[(1, True)] == (4.0, 0.004)  # at this load: the expectation, whatever the luck
    assert g.calibration == (5.0, 4.0) and g.calibrated == 4  # a plain mean while there are few
    assert math.isclose(g.rates[(1, True)], 5.0 / 0.004)  # 4 expected x 5/4 committed per expected
    without = warmed(1, decay=0.5)  # no expectation given: committed tokens, as before
    for committed in (1, 9, 1, 9):
        without.record(1, True, tokens=committed, seconds=0.004)
    assert without.sums[(1, True)][0] == 0.5 * (0.5 * (0.5 * 1 + 0.5 * 9) + 0.5 * 1) + 0.5 * 9
    assert not without.calibrated


def test_the_calibration_pools_every_load_and_plain_steps_leave_it_alone():
    """Drafted steps at one request teach that drafts commit half what they are expected to; a heavier load's first
    drafted samples are read through it at once."""
    g = warmed(1)
    for _ in range(20):
        g.record(1, True, tokens=2, seconds=0.004, expected=4.0)
        g.record(1, False, tokens=1, seconds=0.002, expected=None)
    assert g.calibration == (2.0, 4.0)
    g.record(4, True, tokens=1, seconds=1.0, expected=1.0)  # the warm-up at 4: not averaged, not calibrating
    g.record(4, True, tokens=16, seconds=0.01, expected=16.0)  # this one committed what it was expected to
    assert g.calibrated == 21 and g.calibration == pytest.approx(((20 * 2 + 16) / 21, (20 * 4 + 16) / 21))
    ratio = g.calibration[0] / g.calibration[1]
    assert ratio < 0.6 and math.isclose(g.rates[(3, True)], 16.0 * ratio / 0.01)  # 4 requests: bucket 3 (4-7)
    calibration = g.calibration
    g.record(4, False, tokens=4, seconds=0.004)
    assert g.calibration == calibration


def test_the_engine_hands_the_gate_the_expected_tokens_of_the_drafts_it_verified():
    """A drafted, clean step's expectation is the sum over its rounds of 1 + the survivals of the verified nodes
    (policies.expected_tokens, from the estimator here: the model drafter gives no confidence); plain steps give
    none."""
    from verispec.policies import expected_tokens

    target = tiny_model(4)
    engine = Engine(target, None, EngineConfig(policy="dspark", k=4, drafter="d"),
                    drafters={"d": ModelDrafter(tiny_model(5))})
    script = iter([True, True, True, False])
    engine.gate.draft = lambda n, clean=True, peak=None: next(script, True)
    seen, want = [], []
    schedule = engine._schedule

    def spy(rounds, prefill_tokens):
        schedule(rounds, prefill_tokens)
        want.append(sum(expected_tokens(r.draft, engine._conditional(r)) for r in rounds))

    engine._schedule = spy
    engine.gate.record = lambda r, d, t, s, counted=True, expected=None: seen.append((d, expected))
    engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=16, ignore_eos=True), RequestSpec())
    engine.run_until_done()
    drafted = [(e, w) for (d, e), w in zip(seen, want[1:]) if d]  # want[0]: the prefilling step, not recorded
    assert drafted and all(e is not None and math.isclose(e, w) for e, w in drafted)
    assert all(w > 1 for _, w in drafted)  # some draft verified in each
    assert all(e is None for d, e in seen if not d)
