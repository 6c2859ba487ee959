"""The target's hidden states the engine hands to drafters (Engine._kept_rows): each request's anchor and accepted
rows, gathered once per step, never a view of the step's whole outputs (which hold every request's draft and
prompt rows), so a drafter may keep them as given."""

from __future__ import annotations

import torch
from conftest import tiny_model
from test_block_drafter import make_block

from verispec.config import EngineConfig, RequestSpec, SamplingParams
from verispec.decode import decode
from verispec.drafters import BlockDrafter
from verispec.drafters.base import Verified
from verispec.engine.engine import Engine


def test_drafters_receive_compact_accepted_rows_and_outputs_stay_plain():
    target = tiny_model(0, 0.2)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = [list(range(3 + i, 43 + i)) for i in range(3)]  # 40-token prompts: their rows ride in the forwards
    drafter = BlockDrafter(make_block(target, head="markov", confidence=True), target)
    seen: list[tuple[Verified, int]] = []  # (what accept got, the forward it came from)
    rows: list[int] = []  # each forward's rows
    accept, forward = drafter.accept, target.forward_packed

    def spy_forward(tokens, *a, **kw):
        rows.append(tokens.shape[0])
        return forward(tokens, *a, **kw)

    def spy_accept(result: Verified) -> None:
        seen.append((result, len(rows) - 1))
        accept(result)

    drafter.accept, target.forward_packed = spy_accept, spy_forward
    engine = Engine(target, None, EngineConfig(drafter="b", k=4, prefill_chunk=16), drafters={"b": drafter})
    for i, p in enumerate(prompts):
        engine.add_request(p, params, RequestSpec(), request_id=str(i))
    results = engine.run_until_done()
    assert [results[str(i)].token_ids for i in range(3)] == [decode(target, p, params).token_ids for p in prompts]
    accepted = [0] * len(rows)  # rows the drafter keeps from each forward
    for result, step in seen:
        accepted[step] += result.num_accepted + 1
    for result, step in seen:
        for h in result.target_hidden.values():
            assert h.shape[0] == result.num_accepted + 1  # the anchor and the accepted rows, nothing else
            # one compact copy per step: the accepted rows of every request, not the forward's outputs
            assert h.untyped_storage().nbytes() == accepted[step] * h.shape[1] * h.element_size()
    assert sum(a < r for a, r in zip(accepted, rows) if a) > len(rows) // 2  # most forwards held rows nobody keeps
