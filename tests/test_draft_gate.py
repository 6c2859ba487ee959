"""engine.gate.DraftGate: steps under the dspark policy draft only at loads where drafting has paid."""

from __future__ import annotations

import pytest
from conftest import tiny_model

from verispec.config import EngineConfig, RequestSpec, SamplingParams
from verispec.decode import decode
from verispec.drafters import ModelDrafter
from verispec.engine.engine import Engine
from verispec.engine.gate import DraftGate


def record(g: DraftGate, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
    """Record as the engine does, the first step of each kind at each load (a warm-up) included."""
    if (g.bucket(requests), drafted) not in g.warm:
        g.record(requests, drafted, 1, 1.0)  # a warm-up step, left out of the rates
    g.record(requests, drafted, tokens, seconds)


def test_gate_measures_both_then_follows_the_faster_and_probes_the_other():
    g = DraftGate(probe_every=4, probe_cost=1.0, first=2)  # probes as often as probe_every allows
    first = []
    for _ in range(4):  # nothing known at this load: the two choices alternate, drafting first
        d = g.draft(8)
        first.append(d)
        record(g, 8, d, tokens=8 if d else 9, seconds=0.010 if d else 0.006)  # 800 vs 1,500 tokens/s
    assert first == [True, False, True, False]
    picks = [g.draft(12) for _ in range(8)]  # same bucket (8-15); decisions 5..12
    assert [i + 5 for i, p in enumerate(picks) if p] == [8, 12]  # every 4th decision probes drafting
    assert g.draft(1) is True  # another load is measured on its own
    for _ in range(16):  # the text turns easy: drafting pays again and the probes see it
        record(g, 10, True, tokens=40, seconds=0.012)
    assert g.draft(10) is True


def test_rates_are_sums_warm_ups_are_left_out_and_drafting_keeps_a_margin():
    """Bursty drafting (most steps commit 1 token, one commits 9) is judged by its total tokens over total time,
    not by a typical step; the first step of each kind (a warm-up, 20x slower) is left out; and plain must beat
    drafting by the margin to switch it off."""
    g = DraftGate(first=3, margin=1.1)
    for tokens, seconds in ((1, 0.080), (1, 0.004), (1, 0.004), (9, 0.004), (1, 0.004)):
        g.record(1, True, tokens, seconds)
    for _ in range(4):
        g.record(1, False, 1, 0.0016)  # 625 tokens/s; a typical drafted step is 250
    assert g.rate(1, True) == pytest.approx(12 / 0.016) and g.draft(1) is True
    close = DraftGate(first=1, margin=1.1)
    record(close, 1, True, 10, 0.010)  # 1,000 tokens/s
    record(close, 1, False, 105, 0.100)  # 1,050: better, but within the margin
    assert close.draft(1) is True


def test_a_much_slower_choice_is_probed_rarely():
    """Probing costs at most probe_cost of the time: a choice 3x slower is retried every 40 steps, not every 16;
    and never more rarely than probe_most."""
    g = DraftGate(probe_every=16, probe_cost=0.05, first=1, margin=1.0)
    record(g, 32, True, tokens=32, seconds=0.030)  # drafting: 1,067 tokens/s
    record(g, 32, False, tokens=32, seconds=0.010)  # plain: 3,200 tokens/s, 3x faster
    picks = [g.draft(40) for _ in range(80)]
    assert [i + 1 for i, p in enumerate(picks) if p] == [40, 80]
    hopeless = DraftGate(probe_every=16, probe_cost=0.05, probe_most=128, first=1)
    record(hopeless, 32, True, tokens=1, seconds=1.0)  # 1 token/s: (r - 1) / 0.05 would be ~64,000 steps
    record(hopeless, 32, False, tokens=32, seconds=0.010)
    picks = [hopeless.draft(40) for _ in range(256)]
    assert [i + 1 for i, p in enumerate(picks) if p] == [128, 256]


def test_steps_that_prefill_take_the_better_known_choice_and_are_not_probes():
    g = DraftGate(probe_every=2, probe_cost=1.0, first=1)
    assert g.draft(4, clean=False) is False  # nothing known: plain while the prompt is being prefilled
    record(g, 4, True, tokens=12, seconds=0.010)
    assert g.draft(4, clean=False) is False  # plain still unmeasured
    record(g, 4, False, tokens=4, seconds=0.010)
    assert [g.draft(5, clean=False) for _ in range(4)] == [True] * 4  # drafting is better; no probes
    assert g.steps == {}  # only clean steps count toward the probe schedule


def test_gate_ignores_steps_without_time():
    g = DraftGate()
    g.record(4, True, tokens=3, seconds=0.0)
    assert g.samples == {}


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
