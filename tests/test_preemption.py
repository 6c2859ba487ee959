"""KV on demand and preemption in the engine (issue 22): caches start at the prompt plus a draft round and grow by
`kv_block`; a short pool preempts the newest request, which is recomputed on readmission. A preempted request's
output equals the one it has without preemption: fp32 greedy token for token for every kind of drafter (no
drafter, lookup, a draft model, block and feature drafters reading the target's hidden states, VeriCache reading
its KV), seeded sampling draw for draw, and bf16 greedy on the native kernels. The pool is never exceeded, aborts
of preempted requests free everything, and /metrics counts preemptions."""

from __future__ import annotations

import pytest
import torch
from conftest import no_native_reason, tiny_model
from test_block_drafter import make_block
from test_engine import PROMPTS
from test_feature_drafters import drafter_for

from verispec.config import EngineConfig, RequestSpec, SamplingParams, TreeConfig
from verispec.decode import decode
from verispec.drafters import BlockDrafter, LookupFirstDrafter, ModelDrafter
from verispec.engine import Engine
from verispec.kernels import native
from verispec.serve.metrics import render_metrics

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
# Five requests of up to 23 + 40 + 5 positions in a pool of 120: all start, and growing preempts some.
TIGHT = dict(cache_budget_tokens=120, kv_block=8, k=4, prefill_chunk=16)
VERICACHE = "vericache(compress=streaming, budget=12, sinks=2, horizon=fixed)"


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, 0.2)


@pytest.fixture(scope="module")
def plain(target):
    return [decode(target, p, GREEDY).token_ids for p in PROMPTS]


def drafters(target) -> dict:
    return {
        "self": ModelDrafter(target),
        "other": ModelDrafter(tiny_model(123, 0.5)),
        "dspark": BlockDrafter(make_block(target, head="markov", confidence=True), target),
        "eagle": drafter_for("eagle", target, TreeConfig()),
        "eagle-tree": drafter_for("eagle", target, TreeConfig("auto", 2, 3, 6)),
        "medusa": drafter_for("medusa", target, TreeConfig()),
        "lookup-self": LookupFirstDrafter(ModelDrafter(target)),
        "lookup-other": LookupFirstDrafter(ModelDrafter(tiny_model(123, 0.5))),
    }


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams, RequestSpec]],
        after_step=lambda engine: None) -> list[list[int]]:
    """Add every request at once, step to the end checking the pool (and `after_step`) after every step; outputs in
    order."""
    ids = [engine.add_request(p, params, spec, f"r{i}") for i, (p, params, spec) in enumerate(requests)]
    results = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
        engine.check_invariants()
        after_step(engine)
    engine.check_idle()
    return [results[i].token_ids for i in ids]


@pytest.mark.parametrize("drafter", ["none", "ngram", "self", "other", "dspark", "eagle", "eagle-tree", "medusa",
                                     "lookup-self", VERICACHE])
def test_preempted_greedy_equals_plain(drafter, target, plain):
    engine = Engine(target, None, EngineConfig(drafter=drafter, **TIGHT), drafters=drafters(target))
    outs = run(engine, [(p, GREEDY, RequestSpec()) for p in PROMPTS])
    assert outs == plain
    assert engine.metrics.preemptions > 0 and engine.metrics.recomputed_tokens > 0


@pytest.mark.parametrize("drafter", ["none", "ngram", "other", "dspark", "eagle", "lookup-other"])
def test_preempted_seeded_sampling_draws_what_it_draws_unpreempted(drafter, target):
    """Seeded requests sample the same tokens with and without preemptions: the generator, stop checker and
    statistics carry over, and the drafter restarts from the committed tokens in the state it had."""
    requests = [(p, SamplingParams(max_tokens=40, temperature=t, seed=s, ignore_eos=True), RequestSpec())
                for p, t, s in zip(PROMPTS, (1.0, 0.8, 1.3, 1.0, 0.9), range(5))]
    roomy = Engine(target, None, EngineConfig(drafter=drafter, k=4, prefill_chunk=16), drafters=drafters(target))
    tight = Engine(target, None, EngineConfig(drafter=drafter, **TIGHT), drafters=drafters(target))
    assert run(tight, requests) == run(roomy, requests)
    assert tight.metrics.preemptions > 0 and roomy.metrics.preemptions == 0


def test_caches_grow_on_demand_so_more_requests_run(target, plain):
    """Reserving prompt + max_tokens up front ran two of these at once in this pool; on demand all five start."""
    engine = Engine(target, None, EngineConfig(drafter="ngram", cache_budget_tokens=150, kv_block=8, k=4),
                    drafters=drafters(target))
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, RequestSpec(), f"r{i}")
    engine.step()
    assert len(engine.running) == 5
    assert all(r.cache.max_len < r.max_positions for r in engine.running)
    results = engine.run_until_done()
    assert [results[f"r{i}"].token_ids for i in range(5)] == plain
    engine.check_idle()


def test_the_oldest_request_keeps_its_cache(target, plain):
    """Preemption takes the newest request first (first come, first served): the first request never waits."""
    engine = Engine(target, None, EngineConfig(drafter="ngram", **TIGHT), drafters=drafters(target))
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, RequestSpec(), f"r{i}")
    first = None
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
        first = first or next(r for r in engine.running if r.request_id == "r0")
        assert first.preemptions == 0
    assert engine.metrics.preemptions > 0


def test_aborting_preempted_requests_frees_everything(target, plain):
    engine = Engine(target, None, EngineConfig(drafter="self", **TIGHT), drafters=drafters(target))
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, RequestSpec(), f"r{i}")
    while not engine.metrics.preemptions:
        engine.step()
    preempted = [r.request_id for r in engine.waiting if r.preemptions]
    assert preempted
    for rid in preempted:
        engine.abort(rid)
    results = engine.run_until_done()
    assert {rid for rid, r in results.items() if r.finish_reason == "abort"} == set(preempted)
    for rid, r in results.items():
        if r.finish_reason != "abort":
            assert r.token_ids == plain[int(rid[1:])]
    engine.check_idle()


@pytest.mark.parametrize("drafter", ["none", "dspark"])
def test_bf16_native_preempted_equals_plain(drafter):
    """On the native kernels every row is computed alone, so recomputed rows are the rows decoding wrote."""
    if not native.available():
        pytest.skip(no_native_reason())
    target = tiny_model(0, 0.2).to(torch.bfloat16).pack_weights()
    plain = [decode(target, p, GREEDY).token_ids for p in PROMPTS]
    engine = Engine(target, None, EngineConfig(drafter=drafter, **TIGHT), drafters=drafters(target))
    assert run(engine, [(p, GREEDY, RequestSpec()) for p in PROMPTS]) == plain
    assert engine.metrics.preemptions > 0


def test_metrics_show_preemptions_and_pool_use(target):
    engine = Engine(target, None, EngineConfig(drafter="ngram", **TIGHT), drafters=drafters(target))
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, RequestSpec(), f"r{i}")
    while not engine.metrics.preemptions:
        engine.step()
    text = render_metrics(engine)
    assert f"verispec:num_preemptions_total {engine.metrics.preemptions}" in text
    use = float(next(line for line in text.splitlines() if line.startswith("verispec:kv_cache_usage_perc ")).split()[1])
    assert use == engine.reserved_tokens / 120 and 0.5 < use <= 1.0
    engine.run_until_done()
    assert "verispec:kv_cache_usage_perc 0.0" in render_metrics(engine)


def test_a_block_as_large_as_a_request_reserves_it_whole(target, plain):
    """kv_block >= prompt + max_tokens + draft: each cache is its request's whole need from admission on, so
    requests wait instead of being preempted (the reservation the engine made before KV on demand)."""
    engine = Engine(target, None, EngineConfig(drafter="ngram", cache_budget_tokens=150, kv_block=1 << 20, k=4),
                    drafters=drafters(target))
    running = []

    def whole(engine: Engine) -> None:
        assert all(r.cache.max_len == r.max_positions for r in engine.running)
        running.append(len(engine.running))

    assert run(engine, [(p, GREEDY, RequestSpec()) for p in PROMPTS], whole) == plain
    assert max(running) == 2 and engine.metrics.preemptions == 0
