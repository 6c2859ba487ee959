"""Draft shapes and drafter capabilities: a draft is a tree of nodes (parent indices, q rows and confidences per
node); a chain is the tree whose parents are -1, 0, ..., k-2. Drafters propose chains unless they declare trees
(the model drafter with a tree config); decode and the engine refuse a tree from a drafter that does not. What a drafter needs (hidden layers, the target's KV) and yields (trees) is instance data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_model
from test_block_drafter import make_block

import verispec
from verispec.config import EngineConfig, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import (
    BlockDrafter, Capabilities, Draft, Drafter, DraftRequest, LookupFirstDrafter, ModelDrafter, NgramDrafter,
)
from verispec.drafters.base import chain_parents
from verispec.engine import Engine
from verispec.errors import ConfigError
from verispec.round import verify_round


def test_a_chain_is_the_tree_with_parents_minus_one_to_k_minus_two():
    chain = Draft.chain([4, 5, 6], torch.full((3, 8), 0.125), torch.tensor([0.9, 0.8, 0.7]))
    assert chain.is_chain and chain.parents is None and chain.node_parents == (-1, 0, 1) == chain_parents(3)
    explicit = Draft([4, 5, 6], parents=(-1, 0, 1))
    assert explicit.is_chain and explicit.parents is None  # one representation per chain
    cut = chain.truncated(2)
    assert cut.tokens == [4, 5] and cut.probs.shape == (2, 8) and cut.confidence.tolist() == pytest.approx([0.9, 0.8])


def test_tree_nodes_carry_parents_q_rows_and_confidences():
    tree = Draft([4, 5, 6, 7], torch.full((4, 8), 0.125), torch.ones(4), parents=(-1, -1, 0, 1))
    assert not tree.is_chain and tree.node_parents == (-1, -1, 0, 1)
    assert tree.truncated(3).parents == (-1, -1, 0) and tree.truncated(2).node_parents == (-1, -1)
    assert Draft([4, 5, 6], parents=(-1, -1, 0)).truncated(1).is_chain
    for bad in ((-1, 0), (-1, 1, 0), (-2, 0, 1), (-1, 0, 2)):  # wrong length, a forward parent, out of range
        with pytest.raises(ValueError, match="parents"):
            Draft([4, 5, 6], parents=bad)
    with pytest.raises(ValueError, match="confidences"):
        Draft([4, 5, 6], confidence=torch.ones(2))
    with pytest.raises(ValueError, match="probability rows"):
        Draft([4, 5, 6], probs=torch.ones(2, 8))


def test_drafters_propose_chains():
    req = DraftRequest(0, [1, 2, 3, 1, 2, 3, 1, 2], 4, SamplingParams(), None)
    (draft,) = NgramDrafter().propose([req])
    assert draft.tokens and draft.is_chain


class TreeDrafter(Drafter):
    name = "tree"

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft([1, 2], parents=(-1, -1)) for _ in requests]


def test_decode_and_the_engine_refuse_an_undeclared_tree_draft():
    target = tiny_model()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with pytest.raises(ValueError, match="tree draft"):
        decode(target, [3, 4, 5], params, drafter=TreeDrafter(), spec=SpecConfig(k=2))
    engine = Engine(target, None, EngineConfig(k=2, drafter="tree"), drafters={"tree": TreeDrafter()})
    engine.add_request([3, 4, 5], params)
    with pytest.raises(ValueError, match="tree draft"):
        engine.run_until_done()
    verdict = verify_round(torch.zeros(3, 97), Draft([1, 2], parents=(-1, -1)), params, "rejection", None)
    assert verdict.tokens == [0] and verdict.path == ()  # the round itself verifies trees (tests/test_tree_*.py)


class KVReader(Drafter):
    """A self-speculative drafter that reads the target's KV cache: records what decode and the engine lend it."""

    name = "kv-reader"
    capabilities = Capabilities(reads_target_kv=True)

    def __init__(self) -> None:
        self.caches: dict[int, object] = {}
        self.seen: list[tuple[int, int]] = []  # (cache rows, committed tokens) at each proposal

    def attach_cache(self, seq_id, cache) -> None:
        self.caches[seq_id] = cache

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        self.seen += [(self.caches[r.seq_id].length, len(r.tokens)) for r in requests]
        return [Draft.chain([5]) for _ in requests]


def test_capabilities_are_instance_data_and_compose():
    target = tiny_model()
    assert NgramDrafter().capabilities == Capabilities() and not TreeDrafter().capabilities.trees
    block = BlockDrafter(make_block(target), target)
    # the default (parallel) head draws a tree a request asks for; its own default shape stays a chain; one block
    # forward proposes every position
    assert block.capabilities == Capabilities(hidden_layers=(1,), tree_requests=True, one_pass=True)
    assert LookupFirstDrafter(block).capabilities == block.capabilities  # a composed drafter: its inner one's
    assert LookupFirstDrafter(ModelDrafter(target)).capabilities == Capabilities(tree_requests=True)


def test_decode_and_the_engine_lend_the_target_cache_to_a_drafter_that_reads_it():
    """The lent cache is the one the target verifies with: at every proposal it holds committed tokens only (all
    but the anchor in decode; the engine's first round may still carry prompt rows with it)."""
    target = tiny_model()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    reader = KVReader()
    out = decode(target, [3, 4, 5], params, drafter=reader, spec=SpecConfig(k=2))
    assert len(out.token_ids) == 6 and reader.seen and all(rows == n - 1 for rows, n in reader.seen)
    assert decode(target, [3, 4, 5], params).token_ids == out.token_ids
    reader = KVReader()
    engine = Engine(target, None, EngineConfig(k=2, drafter="kv"), drafters={"kv": reader})
    engine.add_request([3, 4, 5], params)
    engine.run_until_done()
    assert reader.seen and all(rows <= n - 1 for rows, n in reader.seen)
    assert reader.seen[-1][0] == reader.seen[-1][1] - 1


def test_decode_and_the_engine_never_branch_on_a_drafter_type_or_name():
    """Capabilities are read as data: the round, the policies, decode and the engine name no drafter class and
    read no drafter's name."""
    import verispec.drafters as drafters

    classes = [n for n in drafters.__all__ if n.endswith("Drafter") and n != "Drafter"]
    src = Path(verispec.__file__).parent
    for path in [src / "decode.py", src / "round.py", src / "policies.py", *sorted((src / "engine").glob("*.py"))]:
        text = path.read_text()
        assert not [c for c in classes if c in text], path
        assert "drafter).name" not in text and "drafter.name" not in text, path
