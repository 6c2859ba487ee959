"""Draft trees from a block drafter's head (issue 21: any drafter that returns top-k at a node builds one): DSpark's
Markov head gives a node's children from the block logits U_{j+1} and the bias from its own token; the parallel
head from U_{j+1} alone. Exact in decode and the engine (greedy and sampled), the rank-0 path is the chain, and the
RNN head (its state follows one path) refuses trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from test_block_drafter import make_block
from test_exactness import S_N, S_PARAMS, S_PROMPT, SV, exact_pair_joints, failures

from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig, TreeConfig
from verispec.decode import decode
from verispec.drafters import DraftRequest, build_drafter
from verispec.drafters.block import BlockDrafter, save_block_drafter
from verispec.engine import Engine
from verispec.errors import ConfigError

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 44, 17, 90, 2, 61, 28], [7, 7, 8]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
TREE = TreeConfig("auto", 2, 4, 8)
HEADS = {"dspark": dict(head="markov", confidence=True), "parallel": dict(head="none")}


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, 0.2)


@pytest.fixture(scope="module")
def plain(target):
    return [decode(target, p, GREEDY).token_ids for p in PROMPTS]


def _drafter(target, head: str, tree: TreeConfig = TREE, vocab: bool = False, **kw) -> BlockDrafter:
    ids = torch.arange(0, target.config.vocab_size, 3) if vocab else None
    return BlockDrafter(make_block(target, block_size=6, **HEADS[head], **kw), target, draft_vocab=ids, tree=tree)


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("vocab", [False, True])
@pytest.mark.parametrize("policy", ["fixed", "dspark"])
def test_greedy_block_trees_equal_plain_in_decode(head, vocab, policy, target, plain):
    for prompt, ref in zip(PROMPTS, plain):
        drafter = _drafter(target, head, vocab=vocab, std=0.1)
        out = decode(target, prompt, GREEDY, drafter=drafter, spec=SpecConfig(k=8, policy=policy))
        assert out.token_ids == ref
        assert out.stats.num_drafts > 0
        assert drafter.live_sequences() == set()


def _primed(drafter: BlockDrafter, target, prompt: list[int], sid: int = 0) -> None:
    _, hidden = target(torch.tensor([prompt]), hidden_layers=drafter.capabilities.hidden_layers)
    drafter.start(sid, prompt)
    drafter.observe(sid, 0, {k: v[0, :-1] for k, v in hidden.items()})


@pytest.mark.parametrize("head", list(HEADS))
def test_a_trees_top_path_is_the_chain(head, target):
    """Greedy: following each level's most probable child from the anchor gives the chain the same drafter
    drafts (the head's bias is taken from each node's own token, as the chain takes it from the previous one)."""
    tree_drafter, chain_drafter = _drafter(target, head, TreeConfig("auto", 3, 5, 15)), None
    chain_drafter = BlockDrafter(tree_drafter.model, target)
    prompt = PROMPTS[1]
    _primed(tree_drafter, target, prompt)
    _primed(chain_drafter, target, prompt)
    tree = tree_drafter.propose([DraftRequest(0, prompt, 15, GREEDY, None)])[0]
    chain = chain_drafter.propose([DraftRequest(0, prompt, 5, GREEDY, None)])[0]
    assert not tree.is_chain and tree.depth <= 5
    path, parent = [], -1
    while True:  # nodes are added siblings by falling q: the first child is the top one
        kids = [i for i, p in enumerate(tree.node_parents) if p == parent]
        if not kids:
            break
        parent = kids[0]
        path.append(tree.tokens[parent])
    assert path == chain.tokens[: len(path)] and len(path) >= 2


def test_engine_mixes_block_trees_and_chains_and_honours_a_requests_tree(target, plain):
    """A dspark drafter drafting chains by default serves a request that asks for a tree, beside chain requests
    and tree requests of a tree drafter, in one batch: every output equals plain decoding."""
    drafters = {"chain": _drafter(target, "dspark", TreeConfig(), std=0.1),
                "tree": _drafter(target, "parallel", std=0.1)}
    engine = Engine(target, None, EngineConfig(k=8, drafter="chain"), drafters=drafters)
    asks = RequestSpec(drafter="chain", tree=TreeConfig("auto", 2, 3, 6))
    specs = [RequestSpec(), asks, RequestSpec(drafter="tree"), asks, RequestSpec(drafter="tree", policy="dspark")]
    for i, spec in enumerate(specs):
        engine.add_request(PROMPTS[i % 3], GREEDY, spec, f"r{i}")
    out = engine.run_until_done()
    for i in range(len(specs)):
        assert out[f"r{i}"].token_ids == plain[i % 3], i
    assert engine.metrics.num_draft_tokens > 0


def test_the_rnn_head_drafts_chains_only(target):
    with pytest.raises(ConfigError, match="RNN head drafts chains only"):
        BlockDrafter(make_block(target, head="rnn"), target, tree=TREE)
    assert not BlockDrafter(make_block(target, head="rnn"), target).capabilities.tree_requests


def test_structured_specs_set_the_tree(tmp_path, target):
    save_block_drafter(make_block(target, head="markov", confidence=True), tmp_path / "d")
    d = build_drafter(f"dspark(path={tmp_path / 'd'}, tree=auto, width=2, depth=3, nodes=5, window=0)",
                      target=target, dtype=torch.float32, device=torch.device("cpu"))
    assert d.tree == TreeConfig("auto", 2, 3, 5) and d.capabilities.trees and d.window == 0
    assert not build_drafter(f"dspark:{tmp_path / 'd'}", target=target, dtype=torch.float32,
                             device=torch.device("cpu")).capabilities.trees
    with pytest.raises(ConfigError, match="takes no option 'colour'"):
        build_drafter(f"dspark(path={tmp_path / 'd'}, colour=red)", target=target, dtype=torch.float32,
                      device=torch.device("cpu"))


@pytest.fixture(scope="module")
def stat_target():
    return tiny_model(0, 0.25, vocab_size=SV, max_position_embeddings=16, num_hidden_layers=1)


def test_sampled_block_trees_follow_the_target(stat_target):
    """A5: seeded runs at temperature 1 with DSpark-head trees (point masses, recursive rejection sampling)."""
    drafter = BlockDrafter(make_block(stat_target, head="markov", confidence=True, block_size=2, std=0.5),
                           stat_target, tree=TreeConfig("auto", 2, 2, 4))
    samples = np.empty((S_N, 3), dtype=np.int64)
    trees = 0
    for i in range(S_N):
        res = decode(stat_target, S_PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=i), drafter=drafter,
                     spec=SpecConfig(k=4))
        samples[i] = res.token_ids
        trees += res.stats.num_draft_tokens > res.stats.num_drafts * 1  # more nodes than one per round: a tree
    assert trees > S_N // 2
    assert failures(samples, exact_pair_joints(stat_target, S_PROMPT, S_PARAMS)) == []


def test_loaded_dspark_trees_stay_exact_on_a_bf16_target(tmp_path, target):
    """As loaded for serving: a bf16 target on CPU (its tree forwards on the native decoder), the drafter in fp32
    over packed weights, a tree asked for in the spec: greedy output equals the bf16 target's plain decoding."""
    from verispec.model import load_model, save_model

    save_model(target, tmp_path / "t")
    bf16 = load_model(tmp_path / "t", "bf16")
    save_block_drafter(make_block(target, head="markov", confidence=True, block_size=6, std=0.1), tmp_path / "d")
    drafter = build_drafter(f"dspark(path={tmp_path / 'd'}, tree=auto, width=2, depth=4, nodes=8)", target=bf16,
                            dtype=torch.bfloat16, device=torch.device("cpu"))
    for prompt in PROMPTS[:2]:
        out = decode(bf16, prompt, GREEDY, drafter=drafter, spec=SpecConfig(k=8))
        assert out.token_ids == decode(bf16, prompt, GREEDY).token_ids
        assert out.stats.num_draft_tokens > out.stats.num_drafts  # trees: more nodes than rounds
