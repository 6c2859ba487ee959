"""The engine's loop thread: it runs with the caller's thread count and the caller's OpenMP workers released."""

from __future__ import annotations

import asyncio

import torch
from conftest import tiny_model

from verispec.config import EngineConfig, RequestSpec, SamplingParams
from verispec.decode import decode
from verispec.engine.async_engine import AsyncEngine, release_openmp_threads
from verispec.engine.engine import Engine


def test_loop_thread_takes_the_callers_thread_count_and_outputs_are_unchanged():
    target = tiny_model(3)
    prompt = list(range(5, 25))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = decode(target, prompt, params).token_ids
    engine = Engine(target, None, EngineConfig(drafter=None))
    seen = []
    step = engine.step
    engine.step = lambda: seen.append(torch.get_num_threads()) or step()
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # torch keeps one count for every thread: the loop thread runs with the caller's
    try:
        aeng = AsyncEngine(engine).start()

        async def run():
            return [o async for o in aeng.generate(prompt, params, RequestSpec())][-1].result

        try:
            assert asyncio.run(run()).token_ids == plain
        finally:
            aeng.shutdown()
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}


def test_release_openmp_threads_finds_the_loaded_runtime():
    torch.ones(256, 256) @ torch.ones(256, 256)  # the runtime is loaded and this thread has used it
    with open("/proc/self/maps") as maps:
        loaded = any("libgomp" in line or "libomp" in line for line in maps)
    released = release_openmp_threads()
    assert released >= 1 if loaded else released == 0
    assert torch.allclose(torch.ones(64, 64) @ torch.ones(64, 64), torch.full((64, 64), 64.0))  # workers come back


def test_start_releases_the_callers_openmp_workers(monkeypatch):
    """Two threads with OpenMP worker pools on 2 vCPUs make every step's workers sleep between regions (2.4x
    slower steps, measured in reports/serve): start() must release the caller's before the loop thread runs."""
    import verispec.engine.async_engine as ae

    calls = []
    monkeypatch.setattr(ae, "release_openmp_threads", lambda: calls.append(1) or 1)
    aeng = AsyncEngine(Engine(tiny_model(3), None, EngineConfig(drafter=None))).start()
    aeng.shutdown()
    assert calls == [1]


def test_a_steps_outputs_cross_to_the_event_loop_in_one_call_and_final_only_gets_one_output(tokenizer):
    """Every wake-up of the event loop's thread takes a CPU from the forward on 2 cores: a step hands all its
    outputs over at once, and a final_only request (a non-streaming response) is woken once, with exactly the
    tokens and text a streaming request sees over all its outputs."""
    target = tiny_model(3, vocab_size=320)
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    prompts = [list(range(5, 25)), list(range(30, 41)), list(range(7, 19))]
    engine = Engine(target, tokenizer, EngineConfig(drafter=None))
    aeng = AsyncEngine(engine).start()

    async def run():
        loop = asyncio.get_running_loop()
        handovers = []
        call = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: handovers.append(a) or call(*a)  # type: ignore[method-assign]
        streams = [aeng.submit(p, params, RequestSpec()) for p in prompts[:2]]
        final = aeng.submit(prompts[2], params, RequestSpec(), final_only=True)
        got = []
        for rid, queue in [*streams, final]:
            got.append([o async for o in aeng.stream(rid, queue)])
        return got, handovers

    try:
        (a, b, c), handovers = asyncio.run(run())
    finally:
        aeng.shutdown()
    for outs, prompt in zip((a, b, c), prompts):
        assert outs[-1].result.token_ids == decode(target, prompt, params).token_ids
    assert len(a) > 2 and len(c) == 1  # streaming: one output a step; final_only: one in all
    assert c[0].token_ids == c[0].result.token_ids and c[0].text == c[0].result.text
    assert [t for o in a for t in o.token_ids] == a[-1].result.token_ids
    assert "".join(o.text for o in a) == a[-1].result.text
    # one hand-over per step for all three requests, not one per output
    assert len(handovers) <= max(len(a), len(b)) + 1 < len(a) + len(b) + len(c)
