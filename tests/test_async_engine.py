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
