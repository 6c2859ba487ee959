"""drafters.tree.TreeCalibration: dynamic trees ranked by how often nodes like each were accepted, not by raw q."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from verispec.config import SamplingParams, SpecConfig, TreeConfig
from verispec.decode import decode
from verispec.drafters import Draft, DraftRequest, ModelDrafter, build_drafter
from verispec.drafters.feature import FeatureDrafter
from verispec.drafters.tree import DynamicTree, TreeCalibration
from verispec.errors import ConfigError

GREEDY = SamplingParams(max_tokens=1)


def test_learn_walks_the_accepted_path_and_counts_every_reached_child():
    cal = TreeCalibration(bins=10, ranks=3, strength=4.0)
    # anchor -> a (q .65), b (q .25); a -> c (q .55), d (q .15)
    draft, q = Draft([10, 11, 12, 13], parents=(-1, -1, 0, 0)), [0.65, 0.25, 0.55, 0.15]
    cal.learn(draft, q, [10, 13, 99])  # a accepted, then d (the second child), then a bonus token past the tree
    reached = {(r, b): v for r, row in enumerate(cal.reached) for b, v in enumerate(row) if v}
    accepted = {(r, b): v for r, row in enumerate(cal.accepted) for b, v in enumerate(row) if v}
    assert reached == {(0, 6): 1, (1, 2): 1, (0, 5): 1, (1, 1): 1}
    assert accepted == {(0, 6): 1, (1, 1): 1}
    cal.learn(draft, q, [7, 8])  # the first level rejected: its two children reached, nothing accepted
    assert cal.reached[0][6] == 2 and cal.accepted[0][6] == 1
    assert cal(0.65, 0) == pytest.approx((1 + 4 * 0.65) / (2 + 4))  # shrunk toward q while the cell is thin
    cal.learn(Draft.chain([1, 2]), [0.5, 0.5], [1, 9])  # a chain: each node its parent's only (rank-0) child
    assert cal.reached[0][5] == 3 and cal.accepted[0][5] == 1 and sum(map(sum, cal.reached)) == 8


def _grow(tree: DynamicTree, vocab: int = 16) -> Draft:
    """Every node's next-token distribution: token (depth) with q 0.5, the next with 0.3, the rest spread."""
    frontier = [-1]
    while frontier:
        probs = torch.full((len(frontier), vocab), 0.2 / (vocab - 2))
        for f, node in enumerate(frontier):
            depth = 0 if node < 0 else tree.nodes[node].depth
            probs[f, depth % vocab], probs[f, (depth + 1) % vocab] = 0.5, 0.3
        frontier = tree.grow(frontier, probs)
    return tree.draft()


def test_a_trees_confidence_is_the_c_it_was_ranked_by_and_calibration_learns_from_q():
    """Draft.confidence of a tree node is its estimated P(accepted | parent accepted), the c the dspark rule
    multiplies along paths: q itself when ranking by q, the calibrated value when calibrating; q() gives the draft
    probabilities the calibration bins by."""
    shape = TreeConfig("auto", width=2, depth=3, nodes=6)
    by_q = DynamicTree(shape, 6)
    raw = _grow(by_q)
    assert raw.confidence.tolist() == pytest.approx(by_q.q())
    cal = TreeCalibration()
    for _ in range(30):  # the top token always accepted
        tree = DynamicTree(shape, 6, cal)
        cal.learn(_grow(tree), tree.q(), list(range(4)))
    tree = DynamicTree(shape, 6, cal)
    d = _grow(tree)
    top = [i for i, t in enumerate(d.tokens) if t == d.node_depths[i] - 1]  # each level's top token
    assert all(tree.q()[i] == pytest.approx(0.5) for i in top)
    assert all(d.confidence[i] > 0.9 for i in top)  # calibrated: accepted every time, not q = 0.5


def test_a_calibrated_tree_follows_the_path_that_is_accepted():
    """Raw q (0.5 for the top token) values a depth-6 node at 0.016, below a sibling at the root (0.3): the tree
    stays shallow. Calibrated by verified trees where the top token was always accepted and its siblings never,
    the same distributions give the top path's full depth."""
    shape = TreeConfig("auto", width=2, depth=6, nodes=8)
    plain = _grow(DynamicTree(shape, 8))
    cal = TreeCalibration()
    for _ in range(50):
        tree = DynamicTree(shape, 8, cal)
        d = _grow(tree)
        # the target commits the top token at each depth: 0, 1, 2, ...
        cal.learn(d, tree.q(), list(range(7)))
    calibrated = _grow(DynamicTree(shape, 8, cal))
    assert plain.depth < 6 and calibrated.depth == 6
    assert calibrated.tokens[: 1] == [0]


def test_rank_is_a_tree_option_and_rejects_unknown_values():
    assert TreeConfig().rank == "calibrated"
    with pytest.raises(ConfigError, match="rank"):
        TreeConfig("auto", rank="best")
    target = tiny_model(0, 0.2)
    drafter = build_drafter("model(tree=auto, width=2, depth=3, nodes=6, rank=q)", target=target,
                            dtype=target.dtype, device=target.device)
    assert drafter.tree.rank == "q"


@pytest.mark.parametrize("rank", ["calibrated", "q"])
def test_greedy_trees_under_either_ranking_equal_plain(rank):
    target, other = tiny_model(0, 0.2), tiny_model(5, 0.2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = [5, 17, 3, 44, 9, 60, 2]
    plain = decode(target, prompt, params).token_ids
    drafter = ModelDrafter(other, TreeConfig("auto", width=2, depth=4, nodes=6, rank=rank))
    for _ in range(2):  # the second run ranks with what the first one learnt
        out = decode(target, prompt, params, drafter=drafter, spec=SpecConfig(k=6))
        assert out.token_ids == plain
    if rank == "calibrated":
        assert sum(map(sum, drafter.calibration.reached)) > 0


def test_an_eagle_chains_confidence_is_calibrated_and_its_rounds_teach_the_calibration():
    """The dspark rule multiplies a chain's confidences: an EAGLE-3/MTP head's raw top probability is far below its
    top token's acceptance, so the chain reports the rank-0 cell's calibrated acceptance (rank=q keeps raw q), and
    every verified chain teaches that cell."""
    from test_feature_drafters import _fresh, make_feature

    target = tiny_model(0, 0.2)
    model, tokens = make_feature(target, "eagle"), [5, 17, 3, 44, 9, 60, 2]
    raw = _fresh(model, target, tokens, TreeConfig(rank="q")).propose([DraftRequest(1, tokens, 4, GREEDY, None)])[0]
    taught = TreeCalibration()
    for _ in range(40):  # chains whose every token was accepted, in every bin
        for q in (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95):
            taught.learn(Draft.chain([1, 2]), [q, q], [1, 2, 3])
    drafter = _fresh(model, target, tokens, TreeConfig())
    drafter.calibration = taught
    mine = drafter.propose([DraftRequest(1, tokens, 4, GREEDY, None)])[0]
    assert mine.tokens == raw.tokens and len(mine.tokens) == 4
    assert mine.confidence.tolist() == pytest.approx([taught(q, 0) for q in raw.confidence.tolist()])
    assert all(c > 0.95 for c in mine.confidence.tolist()) and min(raw.confidence.tolist()) < 0.95

    drafter = FeatureDrafter(model, target, TreeConfig())
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    out = decode(target, tokens, params, drafter=drafter, spec=SpecConfig(k=4, policy="dspark"))
    assert out.token_ids == decode(target, tokens, params).token_ids
    assert sum(drafter.calibration.reached[0]) >= out.stats.num_drafts > 0 and not drafter.calibration.pending


@pytest.mark.parametrize("shape", [TreeConfig(), TreeConfig("auto", 3, 3, 6)])
def test_medusa_confidences_are_calibrated_and_its_rounds_teach_the_calibration(shape):
    """Medusa's heads, like EAGLE-3's, report a top probability far below their tokens' acceptance (the dspark rule
    cut the zoo's 5-head chains to τ 2.0 from 4.1): chains and static trees report their cells' calibrated acceptance
    (rank=q keeps raw q), and every verified draft teaches the calibration."""
    from test_feature_drafters import make_medusa

    from verispec.drafters.medusa import MedusaDrafter

    target = tiny_model(0, 0.2)
    heads, tokens = make_medusa(target), [5, 17, 3, 44, 9, 60, 2]
    _, hidden = target(torch.tensor([tokens]), hidden_layers=(heads.config.target_layer,))

    def fresh(tree: TreeConfig) -> MedusaDrafter:
        d = MedusaDrafter(heads, target, tree)
        d.start(1, tokens)
        d.observe(1, 0, {k: v[0, :-1] for k, v in hidden.items()})
        return d

    raw = fresh(TreeConfig(shape.mode, shape.width, shape.depth, shape.nodes, rank="q"))
    raw_draft = raw.propose([DraftRequest(1, tokens, 6, GREEDY, None)])[0]
    taught = TreeCalibration()
    for _ in range(80):  # drafts whose every node was accepted, in every bin and sibling rank
        for q in (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95):
            for rank in range(taught.ranks):
                taught.reached[rank][taught._cell(q, rank)[1]] += 1
                taught.accepted[rank][taught._cell(q, rank)[1]] += 1
    drafter = fresh(shape)
    drafter.calibration = taught
    mine = drafter.propose([DraftRequest(1, tokens, 6, GREEDY, None)])[0]
    assert mine.tokens == raw_draft.tokens and mine.node_parents == raw_draft.node_parents
    assert all(c > 0.95 for c in mine.confidence.tolist()) and min(raw_draft.confidence.tolist()) < 0.95
    assert drafter.calibration.pending[1][1] == pytest.approx(raw_draft.confidence.tolist())  # learns from raw q

    drafter = MedusaDrafter(heads, target, shape)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    out = decode(target, tokens, params, drafter=drafter, spec=SpecConfig(k=6, policy="dspark"))
    assert out.token_ids == decode(target, tokens, params).token_ids
    assert sum(map(sum, drafter.calibration.reached)) >= out.stats.num_drafts > 0 and not drafter.calibration.pending
