"""Tree rounds in the reference loop and the engine (DESIGN.md exactness contract, for draft trees).

fp32 greedy: speculation with tree drafts equals plain greedy token for token, for scripted tree shapes (the
accepted branch deep and after rejected ones, so the cache's compaction moves rows) and for the model drafter's
EAGLE-2 dynamic trees at several widths, depths and node counts; in `decode` and in the engine with chain and tree
requests in one batch. After every round the target's cache equals a fresh prefill of the committed tokens but the
anchor. Seeded tree sampling is reproducible, and the engine draws what `decode` draws.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import tiny_model

from verispec.cache import KVCache, PackedBatch
from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig, TreeConfig
from verispec.decode import decode
from verispec.drafters import Capabilities, Draft, Drafter, DraftRequest, ModelDrafter, Verified, build_drafter
from verispec.drafters.tree import DynamicTree
from verispec.engine import Engine
from verispec.errors import ConfigError
from verispec.profile import StepProfile
from verispec.round import keep_accepted, tree_inputs, verify_round

VOCAB = 97
PROMPT = [3, 44, 17, 90, 2, 61, 28]
PROMPTS = [PROMPT, [5, 6, 7, 8, 9, 10, 5, 6, 7, 8], [50], [1, 2, 3] * 5]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)

# Scripted shapes: (parents, good) per node; a node carries the target's next greedy token where it and every
# ancestor are good, a wrong one elsewhere. Rounds accept the deepest good path.
SHAPES = {
    "deep-branch-last": ((-1, 0, -1, 2, 3, 3, 5), (False, False, True, True, False, True, True)),
    "wide": ((-1, -1, -1, -1), (False, False, False, True)),
    "balanced": ((-1, -1, 0, 0, 1, 1), (False, True, False, False, True, False)),
    "all-wrong": ((-1, 0, -1), (False, False, False)),
    "chain-with-twigs": ((-1, 0, 0, 1, 3, 3), (True, True, False, True, False, True)),
}


@pytest.fixture(scope="module")
def target():
    return tiny_model(2, 0.5)


@pytest.fixture(scope="module")
def other():
    return tiny_model(123, 0.5)


@pytest.fixture(scope="module")
def plain(target):
    return [decode(target, p, SamplingParams(max_tokens=40, ignore_eos=True)).token_ids for p in PROMPTS]


class OracleTree(Drafter):
    """Proposes a fixed tree shape each round (cut to the budget), its good nodes carrying the target's true
    greedy continuation (plain greedy decoding, computed beforehand). Records (parents, expected, accepted)."""

    name = "oracle-tree"
    capabilities = Capabilities(trees=True)

    def __init__(self, prompts: dict[int, tuple[int, list[int]]], shape: str) -> None:
        self.prompts = prompts  # seq_id -> (prompt length, plain greedy output)
        self.parents, self.good = SHAPES[shape]
        self.pending: dict[int, tuple[tuple[int, ...], int]] = {}
        self.rounds: list[tuple[tuple[int, ...], int, int]] = []

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            prompt_len, oracle = self.prompts[r.seq_id]
            pos = len(r.tokens) - prompt_len
            n = min(r.budget, len(self.parents))
            parents, tokens, depth, fine = self.parents[:n], [], [], []
            for i, p in enumerate(parents):
                depth.append(1 + (depth[p] if p >= 0 else 0))
                fine.append(self.good[i] and (p < 0 or fine[p]))
                true = oracle[pos + depth[i] - 1]
                tokens.append(true if fine[i] else (true + 1 + i) % VOCAB)
            self.pending[r.seq_id] = (parents, max((d for d, f in zip(depth, fine) if f), default=0))
            out.append(Draft(tokens, parents=parents) if tokens else Draft.chain([]))
        return out

    def accept(self, result: Verified) -> None:
        if result.seq_id in self.pending:
            parents, expected = self.pending.pop(result.seq_id)
            self.rounds.append((parents, expected, result.num_accepted))


def fresh_kv(model, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # [L, B, Hkv, T, D] each
    cache = KVCache.for_model(model, max_len=len(tokens) + 1)
    model(torch.tensor([tokens]), cache=cache, num_logits=0)
    return cache.k[:, :, :, : len(tokens)], cache.v[:, :, :, : len(tokens)]


def assert_cache_holds(cache: KVCache, model, tokens: list[int]) -> None:
    """The cache's rows are exactly a fresh prefill of `tokens`."""
    assert cache.length == len(tokens)
    k, v = fresh_kv(model, tokens)
    torch.testing.assert_close(cache.k[:, :, :, : cache.length], k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cache.v[:, :, :, : cache.length], v, atol=1e-4, rtol=1e-4)


class TargetAudit:
    """While active, wraps the target's forward: at every verification forward the loop's cache holds exactly the
    committed tokens but the anchor, whatever the last round's tree kept; `done` checks the cache after the last
    round."""

    def __init__(self, target, prompt: list[int]) -> None:
        self.target, self.committed, self.cache, self.checks = target, list(prompt), None, 0

    def __enter__(self) -> TargetAudit:
        self._orig = self.target.forward
        self.target.forward = self._spy  # an instance attribute: nn.Module.__call__ dispatches to it
        return self

    def __exit__(self, *exc) -> None:
        del self.target.forward

    def _spy(self, tokens, positions=None, cache=None, hidden_layers=(), num_logits=None, attn_mask=None):
        if self.cache is None:
            self.cache = cache  # the prefill
        elif cache is self.cache:
            assert int(tokens[0, 0]) == self.committed[-1]
            assert_cache_holds(cache, self.target, self.committed[:-1])
            self.checks += 1
        return self._orig(tokens, positions=positions, cache=cache, hidden_layers=hidden_layers,
                          num_logits=num_logits, attn_mask=attn_mask)

    def accept(self, result: Verified) -> None:
        self.committed += result.committed

    def done(self) -> None:
        assert_cache_holds(self.cache, self.target, self.committed[:-1])


class Audited(Drafter):
    """A drafter that tells the audit what each round committed."""

    def __init__(self, inner: Drafter, audit: TargetAudit) -> None:
        self.inner, self.audit, self.capabilities = inner, audit, inner.capabilities

    def propose(self, requests):
        return self.inner.propose(requests)

    def accept(self, result: Verified) -> None:
        self.inner.accept(result)
        self.audit.accept(result)


# ------------------------------------------------------------------------------------------------------------
# decode


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("k", [3, 7])
def test_greedy_scripted_trees_equal_plain_and_keep_the_accepted_path(shape, k, target, plain):
    """Each round accepts exactly the deepest good path (the rule), the output is plain greedy's, and the target's
    cache after every round equals a fresh prefill of the committed tokens (the deep branch compacted)."""
    oracle = OracleTree({0: (len(PROMPT), plain[0])}, shape)
    with TargetAudit(target, PROMPT) as audit:
        res = decode(target, PROMPT, GREEDY, drafter=Audited(oracle, audit), spec=SpecConfig(k=k))
    audit.done()
    assert res.token_ids == plain[0][: GREEDY.max_tokens]
    assert oracle.rounds and all(accepted == expected for _, expected, accepted in oracle.rounds)
    assert audit.checks == res.stats.num_rounds
    assert res.stats.num_accepted_tokens == sum(a for _, _, a in oracle.rounds)
    depth = max(Draft([0] * len(parents), parents=parents).depth for parents, _, _ in oracle.rounds)
    assert len(res.stats.accepted_per_pos) == depth  # per-position acceptance counts a tree's depths


@torch.inference_mode()
@pytest.mark.parametrize("pending", [1, 4])
def test_kv_after_a_deep_branch_equals_the_accepted_path_from_scratch(pending, target, plain):
    """One round by hand: `pending` committed tokens (the engine's first round carries prompt rows along) and a
    tree whose accepted branch is three deep and comes after a rejected one; keep_accepted leaves what a fresh
    prefill of the committed tokens holds, and the next forward's logits agree with a fresh cache's."""
    tokens = PROMPT + plain[0][:2]
    cache = KVCache.for_model(target)
    target(torch.tensor([tokens[: len(tokens) - pending]]), cache=cache, num_logits=0)
    truth = plain[0][2:5]
    parents = (-1, 0, -1, 2, 3, 3)
    nodes = [(truth[0] + 1) % VOCAB, 5, truth[0], truth[1], (truth[2] + 1) % VOCAB, truth[2]]
    draft = Draft(nodes, parents=parents)
    positions, mask = tree_inputs(draft, cache, pending, target.device)
    logits, _ = target(torch.tensor([tokens[len(tokens) - pending :] + nodes]), positions[None], cache=cache,
                       attn_mask=mask)
    verdict = verify_round(logits[0, pending - 1 :], draft, GREEDY, "rejection", None)
    assert verdict.path == (2, 3, 5) and verdict.tokens == truth + [plain[0][5]]
    keep_accepted(cache, draft, verdict, len(tokens))
    committed = tokens + verdict.tokens
    assert_cache_holds(cache, target, committed[:-1])
    fresh = KVCache.for_model(target)
    target(torch.tensor([committed[:-1]]), cache=fresh, num_logits=0)
    nxt = torch.tensor([committed[-1:] + [7, 8]])
    torch.testing.assert_close(target(nxt, cache=cache)[0], target(nxt, cache=fresh)[0], atol=1e-5, rtol=0)


TREES = [TreeConfig("auto", 2, 3, 6), TreeConfig("auto", 3, 4, 12), TreeConfig("auto", 4, 2, 5),
         TreeConfig("auto", 1, 5, 5)]


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"w{t.width}d{t.depth}n{t.nodes}")
@pytest.mark.parametrize("kind", ["self", "random"])
def test_model_drafter_dynamic_trees_greedy_equal_plain(tree, kind, target, other, plain):
    """EAGLE-2 trees from the draft model (the target itself: its best path is always accepted; an unrelated
    model: mostly rejected) at several shapes, k = the node count; every prompt equals plain greedy."""
    drafter = ModelDrafter(target if kind == "self" else other, tree)
    assert drafter.capabilities.trees
    for prompt, want in zip(PROMPTS, plain):
        res = decode(target, prompt, GREEDY, drafter=drafter, spec=SpecConfig(k=tree.nodes))
        assert res.token_ids == want[: GREEDY.max_tokens]
        if kind == "self":  # every round accepts at least the top child (the target's own argmax)
            assert res.stats.num_accepted_tokens >= res.stats.num_drafts
    assert not drafter.live_sequences()


def test_a_tree_budget_below_the_node_count_and_a_tiered_cache(target, plain):
    """k caps the tree's nodes (k = 1 gives one-node chains); a tiered cache compacts its store."""
    for k, tier in ((1, None), (3, "cpu")):
        drafter = ModelDrafter(target, TreeConfig("auto", 2, 3, 8))
        res = decode(target, PROMPT, GREEDY, drafter=drafter, spec=SpecConfig(k=k, kv_tier=tier))
        assert res.token_ids == plain[0][: GREEDY.max_tokens] and max(res.stats.accepted_per_pos, default=0) > 0
        assert len(res.stats.accepted_per_pos) <= k


def test_the_draft_model_cache_holds_committed_tokens_only_between_rounds(target, other):
    """The tree's rows leave the drafter's cache after each proposal: it holds a prefix of the committed tokens."""
    drafter = ModelDrafter(other, TreeConfig("auto", 3, 3, 8))
    seen = []
    real_accept = drafter.accept

    def accept(result: Verified) -> None:
        real_accept(result)
        cache = drafter._caches[result.seq_id]
        seen.append(cache.length)
        assert cache.length <= drafter._round_start[result.seq_id]

    drafter.accept = accept
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=4)
    res = decode(target, PROMPT, params, drafter=drafter, spec=SpecConfig(k=8))
    assert len(seen) == res.stats.num_rounds


def test_seeded_tree_sampling_is_reproducible(target, other):
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=11)
    runs = [decode(target, PROMPT, params, drafter=ModelDrafter(other, TreeConfig("auto", 3, 3, 8)),
                   spec=SpecConfig(k=8)).token_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 20


# ------------------------------------------------------------------------------------------------------------
# engine


def _run_audited(engine: Engine, arrivals: dict[int, list[tuple]]) -> dict[str, object]:
    """Step with staggered arrivals; after every step each running request's cache equals a fresh prefill of its
    committed tokens but the anchor (once its prompt is in)."""
    results, step = {}, 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for args in arrivals.pop(step, []):
            engine.add_request(*args[:3], request_id=args[3])
        for out in engine.step():
            if out.result is not None:
                results[out.request_id] = out.result
        engine.check_invariants()
        _audit_caches(engine)
        step += 1
    engine.check_idle()
    return results


def _audit_caches(engine: Engine) -> None:  # a function: no Request outlives it (check_idle counts them)
    for req in engine.running:
        if req.stats.num_rounds:
            assert_cache_holds(req.cache, engine.target, req.tokens[:-1])


def test_engine_mixed_chain_and_tree_requests_equal_plain(target, other, plain):
    drafters = {
        "tree-self": ModelDrafter(target, TreeConfig("auto", 2, 3, 6)),
        "tree-random": ModelDrafter(other, TreeConfig("auto", 3, 3, 8)),
        "chain-self": ModelDrafter(target),
        "oracle-tree": OracleTree({}, "deep-branch-last"),
    }
    profile = StepProfile({}, (1, 4, 8, 16, 64), (1.0, 1.1, 1.6, 3.0, 12.0), 0.05, 0)  # as test_engine's
    engine = Engine(target, None, EngineConfig(k=8, drafter="ngram", prefill_chunk=6), drafters=drafters,
                    profile=profile)
    specs = ["tree-self", "chain-self", "tree-random", "ngram", "oracle-tree", "none", "tree-self", "oracle-tree",
             "model(tree=auto, width=2, depth=2, nodes=4)", "tree-random"]
    arrivals: dict[int, list[tuple]] = {}
    for i, name in enumerate(specs):
        p = i % len(PROMPTS)
        if name == "oracle-tree":  # the engine numbers sequences in arrival order
            drafters[name].prompts[i] = (len(PROMPTS[p]), plain[p])
        spec = RequestSpec(drafter=name, policy="dspark" if i == 9 else None)  # dspark cuts a tree to a subtree
        arrivals.setdefault(i // 2 * 2, []).append((PROMPTS[p], GREEDY, spec, f"r{i}"))
    results = _run_audited(engine, arrivals)
    for i, name in enumerate(specs):
        assert results[f"r{i}"].token_ids == plain[i % len(PROMPTS)][: GREEDY.max_tokens], f"request {i} ({name})"
    rounds = drafters["oracle-tree"].rounds
    assert rounds and all(accepted == expected for _, expected, accepted in rounds)


class SoftTree(Drafter):
    """SpecInfer-style trees: every node sampled (with the request's generator) from a q that depends on the
    position only, and carried with its q row."""

    name = "soft-tree"
    capabilities = Capabilities(trees=True)
    PARENTS = (-1, -1, 0, 1, 1)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            n = min(r.budget, len(self.PARENTS))
            q = torch.softmax(torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(len(r.tokens))) * 3, -1)
            tokens = torch.multinomial(q, 1, generator=r.generator).squeeze(1).tolist()
            out.append(Draft(tokens, q, parents=self.PARENTS[:n]) if n else Draft.chain([]))
        return out


def test_engine_tree_sampling_draws_what_decode_draws(target, other):
    """Seeded tree requests (point masses and soft q, verified in one call per kind) next to chain requests draw
    exactly what the reference loop draws."""
    tree = TreeConfig("auto", 3, 3, 8)
    cases = {"t0": (PROMPT, 21, "tree"), "t1": (PROMPTS[1], 22, "tree"), "s0": (PROMPTS[2], 23, "soft"),
             "s1": (PROMPTS[3], 24, "soft")}
    made = {"tree": lambda: ModelDrafter(other, tree), "soft": SoftTree, "chain": lambda: ModelDrafter(other)}
    want = {}
    for rid, (prompt, seed, kind) in cases.items():
        params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=seed)
        want[rid] = decode(target, prompt, params, drafter=made[kind](), spec=SpecConfig(k=8)).token_ids
    engine = Engine(target, None, EngineConfig(k=8, drafter="chain"), drafters={k: f() for k, f in made.items()})
    sampled = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=5)
    arrivals = {0: [(PROMPTS[1], GREEDY, RequestSpec(), "c0")], 1: [(PROMPTS[3], sampled, RequestSpec(), "c1")]}
    for rid, (prompt, seed, kind) in cases.items():
        arrivals[0].append((prompt, replace(sampled, seed=seed), RequestSpec(drafter=kind), rid))
    results = _run_audited(engine, arrivals)
    for rid in cases:
        assert results[rid].token_ids == want[rid], rid
    assert engine.metrics.num_accepted_tokens > 0


# ------------------------------------------------------------------------------------------------------------
# pieces: the packed tree forward, the tree builder, the spec


@torch.inference_mode()
def test_a_packed_tree_segment_scores_as_a_lone_tree_forward(target):
    """A tree segment in a packed batch (next to a causal one) gives the logits of the same tree run alone."""
    draft = Draft([4, 9, 11, 13], parents=(-1, -1, 0, 1))
    lone = KVCache.for_model(target)
    target(torch.tensor([PROMPT[:-1]]), cache=lone, num_logits=0)
    positions, mask = tree_inputs(draft, lone, 1, target.device)
    want, _ = target(torch.tensor([[PROMPT[-1], *draft.tokens]]), positions[None], cache=lone, attn_mask=mask)
    a, b = KVCache.for_model(target), KVCache.for_model(target)
    target(torch.tensor([PROMPT[:-3]]), cache=a, num_logits=0)  # two prompt rows ride along with the tree
    target(torch.tensor([[5, 6, 7]]), cache=b, num_logits=0)
    tree = tree_inputs(draft, a, 3, target.device)
    seg = PROMPT[-3:] + draft.tokens
    batch = PackedBatch.build([a, b], [len(seg), 2], target.device, [tree, None])
    assert batch.causal == (False, True)
    got, _ = target.forward_packed(torch.tensor(seg + [8, 9]), batch, torch.arange(2, 2 + 5))
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=0)


def test_dynamic_tree_expands_the_best_nodes_and_keeps_a_connected_top_n():
    tree = DynamicTree(TreeConfig("auto", width=2, depth=3, nodes=4), max_nodes=4)
    root = torch.tensor([[0.6, 0.3, 0.1, 0.0]])
    frontier = tree.grow([-1], root)
    assert [tree.nodes[i].token for i in frontier] == [0, 1]
    assert [n.value for n in tree.nodes] == pytest.approx([0.6, 0.3])
    frontier = tree.grow(frontier, torch.tensor([[0.1, 0.0, 0.9, 0.0], [0.6, 0.4, 0.0, 0.0]]))
    # new: 0->2 (0.54), 0->0 (0.06), 1->0 (0.18), 1->1 (0.12): the best two are expanded
    assert [(tree.nodes[i].token, round(tree.nodes[i].value, 2)) for i in frontier] == [(2, 0.54), (0, 0.18)]
    assert tree.grow(frontier, torch.tensor([[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])) == []  # depth 3
    draft = tree.draft()
    # best four: 0 (0.6), 0->2 (0.54), 0->2->3 (0.54), 1 (0.3); in the order added, parents first
    assert draft.tokens == [0, 1, 2, 3] and draft.parents == (-1, -1, 0, 2)
    assert draft.probs is None and draft.confidence.tolist() == pytest.approx([0.6, 0.3, 0.9, 1.0])
    small = DynamicTree(TreeConfig("auto", width=2, depth=3, nodes=2), max_nodes=2)
    frontier = small.grow(small.grow([-1], root), torch.tensor([[0.1, 0.0, 0.9, 0.0], [0.6, 0.4, 0.0, 0.0]]))
    assert [small.nodes[i].token for i in frontier] == [2]  # 1->0 (0.18) ranks below two others: never kept
    one = DynamicTree(TreeConfig("auto", 3, 3, 8), max_nodes=1)
    one.grow([-1], root)
    assert one.draft().is_chain and one.draft().tokens == [0]


def test_model_drafter_spec_options(target):
    def build(spec):
        return build_drafter(spec, target=target, dtype=torch.float32, device=target.device)

    assert not build("model").capabilities.trees and build("model").tree == TreeConfig()
    drafter = build("model(tree=auto, width=2, depth=3, nodes=6)")
    assert drafter.capabilities.trees and drafter.tree == TreeConfig("auto", 2, 3, 6)
    assert not build("model(tree=off)").capabilities.trees
    for bad, match in (("model(tree=maybe)", "tree must be"), ("model(width=x)", "integer"),
                       ("model(tree=auto, depth=0)", "depth"), ("model(speed=9)", "no option")):
        with pytest.raises(ConfigError, match=match):
            build(bad)
