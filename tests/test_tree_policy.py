"""The dspark policy over draft trees (issue 21's per-node verification budgets): Algorithm 1 ranks every node of
every request's draft by its path survival and admits them parents first while expected tokens per second still
grow, so a tree is cut to a subtree. Exact whatever it cuts (greedy equality in decode and the engine, the sampling
statistics), and a sampled chain's confidences never read the token they belong to."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import tiny_model
from test_decode_policy import cuts, linear_profile  # noqa: F401 - cuts is a fixture
from test_exactness import S_N, S_PARAMS, S_PROMPT, SV, exact_pair_joints, failures
from test_feature_drafters import PROMPTS, make_feature, make_medusa

from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig, TreeConfig
from verispec.decode import decode
from verispec.drafters import Capabilities, Draft, Drafter, DraftRequest, ModelDrafter
from verispec.drafters.feature import FeatureDrafter
from verispec.drafters.medusa import MedusaDrafter
from verispec.engine import Engine
from verispec.policies import dspark_lengths, dspark_nodes, survival

GREEDY = SamplingParams(max_tokens=30, ignore_eos=True)
TREE = TreeConfig("auto", 2, 4, 8)


def test_survival_follows_each_nodes_path():
    parents = (-1, -1, 0, 0, 2)
    assert survival([0.8, 0.5, 0.5, 0.25, 0.5], parents) == pytest.approx([0.8, 0.5, 0.4, 0.2, 0.2])
    assert survival([0.5, 0.5, 2.0]) == survival([0.5, 0.5, 2.0], (-1, 0, 1)) == [0.5, 0.25, 0.25]


def test_nodes_are_admitted_by_path_survival_until_a_node_stops_paying():
    surv, depths = [[0.8, 0.5, 0.4, 0.2, 0.2]], [[1, 1, 2, 2, 3]]
    assert dspark_nodes(surv, depths, 1, 1.0, lambda b: 1.0) == [[0, 1, 2, 3, 4]]
    # 1 + 0.2 (B - 1) seconds a step: 0.8, 0.5 and 0.4 raise tokens per second (1.5, 1.64, 1.69), 0.2 does not
    assert dspark_nodes(surv, depths, 1, 1.0, lambda b: 1 + 0.2 * (b - 1)) == [[0, 1, 2]]
    # budgets over requests: the second request's likelier node goes before the first one's deeper ones
    two = dspark_nodes([[0.9, 0.3], [0.6]], [[1, 2], [1]], 2, 2.0, lambda b: 1 + 0.25 * (b - 2))
    assert two == [[0], [0]]


def test_random_trees_admit_subtrees_and_chains_keep_their_prefix_rule():
    rng = random.Random(0)
    for _ in range(300):
        drafts, cs = [], []
        for _ in range(rng.randint(1, 3)):
            n = rng.randint(1, 9)
            parents = tuple(rng.randint(-1, i - 1) for i in range(n)) if rng.random() < 0.7 else None
            drafts.append(Draft(list(range(n)), parents=parents))
            cs.append([rng.choice([1.0, rng.random()]) for _ in range(n)])
        slope = rng.random()
        got = dspark_nodes([survival(c, d.parents) for d, c in zip(drafts, cs)], [d.node_depths for d in drafts],
                           len(drafts), float(len(drafts)), lambda b: 1 + slope * b)
        for d, nodes in zip(drafts, got):
            assert all(d.node_parents[n] < 0 or d.node_parents[n] in nodes for n in nodes)
            d.keep(nodes)  # a subtree, so it can be kept
        if all(d.is_chain for d in drafts):
            lengths = dspark_lengths([survival(c) for c in cs], len(drafts), float(len(drafts)),
                                     lambda b: 1 + slope * b)
            assert [len(n) for n in got] == lengths and all(n == list(range(len(n))) for n in got)


def test_draft_keep_reindexes_a_subtree():
    d = Draft([10, 11, 12, 13, 14], torch.eye(5, 20), torch.arange(5.0), (-1, -1, 0, 0, 2))
    kept = d.keep([0, 2, 4])
    assert kept.tokens == [10, 12, 14] and kept.is_chain  # a path is stored as a chain
    assert torch.equal(kept.probs, d.probs[[0, 2, 4]]) and kept.confidence.tolist() == [0.0, 2.0, 4.0]
    assert d.keep([0, 1, 3]).parents == (-1, -1, 0)
    assert d.keep([0, 1, 2, 3, 4]) is d and d.keep([]).tokens == []
    with pytest.raises(ValueError, match="not a subtree"):
        d.keep([0, 4])
    assert Draft.chain([1, 2, 3]).keep([0, 1]).tokens == [1, 2]
    with pytest.raises(ValueError, match="not a subtree"):
        Draft.chain([1, 2, 3]).keep([0, 2])


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, 0.2)


@pytest.fixture(scope="module")
def plain(target):
    return [decode(target, p, GREEDY).token_ids for p in PROMPTS[:2]]


def _tree_drafters(target):
    return {"eagle": lambda: FeatureDrafter(make_feature(target, "eagle", packed=True), target, TREE),
            "model": lambda: ModelDrafter(tiny_model(3, 0.2), TREE)}


@pytest.mark.parametrize("kind", ["eagle", "model"])
@pytest.mark.parametrize("per_token", [0.05, 0.3])
def test_greedy_trees_cut_by_the_rule_equal_plain_in_decode(kind, per_token, target, plain, cuts):  # noqa: F811
    for prompt, ref in zip(PROMPTS[:2], plain):
        res = decode(target, prompt, GREEDY, drafter=_tree_drafters(target)[kind](),
                     spec=SpecConfig(k=8, policy="dspark"), profile=linear_profile(per_token))
        assert res.token_ids == ref
    assert cuts["cut"] > 0  # some trees were verified as a strict subtree


def test_engine_cuts_trees_and_chains_in_one_step_and_stays_exact(target, plain):
    """Tree and chain requests under the dspark policy share each step's node budget; every output equals plain
    decoding, and trees are cut to subtrees (fewer nodes verified than proposed)."""
    drafters = {"eagle": _tree_drafters(target)["eagle"](), "chain": ModelDrafter(tiny_model(3, 0.2))}
    proposed = {"nodes": 0}
    propose = drafters["eagle"].propose

    def counting(requests):
        out = propose(requests)
        proposed["nodes"] += sum(len(d.tokens) for d in out)
        return out

    drafters["eagle"].propose = counting
    engine = Engine(target, None, EngineConfig(policy="dspark", k=8, drafter="chain"), drafters=drafters,
                    profile=linear_profile(0.15))
    engine.gate.draft = lambda *a, **k: True  # draft every step: the cut, not the gate, is under test
    for i in range(4):
        engine.add_request(PROMPTS[i % 2], GREEDY, RequestSpec(drafter="eagle" if i < 2 else "chain"), f"r{i}")
    out = engine.run_until_done()
    for i in range(4):
        assert out[f"r{i}"].token_ids == plain[i % 2], i
    tree_nodes = sum(out[f"r{i}"].stats.num_draft_tokens for i in range(2))
    assert 0 < tree_nodes < proposed["nodes"]


@pytest.fixture(scope="module")
def stat_target():
    return tiny_model(0, 0.25, vocab_size=SV, max_position_embeddings=16, num_hidden_layers=1)


class SoftTree(Drafter):
    """SpecInfer-style trees over the statistical vocabulary: every node drawn (with the request's generator) from a
    q that depends on the position only, carried with its q row and no confidence."""

    name = "soft-tree"
    capabilities = Capabilities(trees=True)
    PARENTS = (-1, 0, -1, 1)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            n = min(r.budget, len(self.PARENTS))
            q = torch.softmax(torch.randn(n, SV, generator=torch.Generator().manual_seed(len(r.tokens))) * 2, -1)
            tokens = torch.multinomial(q, 1, generator=r.generator).squeeze(1).tolist()
            out.append(Draft(tokens, q, parents=self.PARENTS[:n]) if n else Draft.chain([]))
        return out


@pytest.mark.parametrize("kind", ["point-mass tree", "soft tree"])
def test_sampled_trees_cut_by_the_rule_follow_the_target(kind, stat_target, cuts):  # noqa: F811
    """A5 over trees cut to subtrees: top-k point masses ranked by q (the cut reads q of the node itself, which
    point masses allow) and SpecInfer-style sampled nodes with q rows (cut from past acceptance by depth)."""
    draft_model = tiny_model(1, 0.25, vocab_size=SV, max_position_embeddings=16, num_hidden_layers=1)
    make = (lambda: ModelDrafter(draft_model, TreeConfig("auto", 2, 2, 4))) if kind == "point-mass tree" else SoftTree
    samples = np.empty((S_N, 3), dtype=np.int64)
    for i in range(S_N):
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=i)
        res = decode(stat_target, S_PROMPT, params, drafter=make(), spec=SpecConfig(k=4, policy="dspark"),
                     profile=linear_profile(0.22 if kind == "point-mass tree" else 0.25))  # both sides, often
        samples[i] = res.token_ids
    assert cuts["cut"] > S_N // 10 and cuts["whole"] > S_N // 10
    assert failures(samples, exact_pair_joints(stat_target, S_PROMPT, S_PARAMS)) == []


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_sampled_chains_confidence_never_reads_its_own_token(kind, target):
    """The dspark cut of a sampled chain must not depend on the token it cuts (DSpark appendix A): position 1's
    confidence is the same whichever token the seed draws there."""
    if kind == "eagle":
        drafter = FeatureDrafter(make_feature(target, "eagle", packed=True, std=0.5), target)
    else:
        drafter = MedusaDrafter(make_medusa(target, std=0.5), target)
    prompt = PROMPTS[1]
    _, hidden = target(torch.tensor([prompt]), hidden_layers=drafter.capabilities.hidden_layers)
    params = SamplingParams(max_tokens=8, temperature=1.5)
    seen: dict[int, float] = {}
    for seed in range(40):
        drafter.start(seed, prompt)
        drafter.observe(seed, 0, {k: v[0, :-1] for k, v in hidden.items()})
        d = drafter.propose([DraftRequest(seed, prompt, 3, params, torch.Generator().manual_seed(seed))])[0]
        drafter.finish(seed)
        seen[d.tokens[0]] = float(d.confidence[0])
    assert len(seen) > 1  # different first tokens were drawn
    assert max(seen.values()) - min(seen.values()) < 1e-6
