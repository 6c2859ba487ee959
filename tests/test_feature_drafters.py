"""EAGLE-3, MTP and Medusa drafters with random weights (DESIGN.md exactness contract): greedy output equals plain
decoding for chains and trees in `decode` and the engine, sampled output follows the target (with a negative
control), the training-time-test forward drafts what inference drafts, the drafters' own state equals a
recomputation after any rounds and rollbacks, checkpoints load or fail clearly, and training runs, resumes and
raises tau."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _markov import tv_limit
from conftest import tiny_continuations, tiny_model
from test_exactness import ALPHA, S_PARAMS, S_PROMPT, SV, check_pair, exact_pair_joints

from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig, TreeConfig
from verispec.decode import decode
from verispec.drafters import Draft, DraftRequest, LookupFirstDrafter, ModelDrafter, Verified, build_drafter
from verispec.drafters.feature import FeatureDrafter, load_feature_drafter, save_feature_drafter
from verispec.drafters.medusa import MedusaDrafter, load_medusa, save_medusa
from verispec.engine import Engine
from verispec.errors import CheckpointError, ConfigError
from verispec.model import save_model
from verispec.model.feature import FeatureConfig, FeatureDraftModel
from verispec.model.medusa import MedusaConfig, MedusaHeads, sparse_tree
from verispec.train.feature import FeatureTrainConfig, evaluate, finish_medusa, train_feature_drafter

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 44, 17, 90, 2, 61, 28], [7]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
TREES = {"chain": TreeConfig(), "tree": TreeConfig("auto", 2, 3, 6), "wide": TreeConfig("auto", 4, 2, 9)}


def _randomize(model, seed: int, std: float):
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            torch.nn.init.normal_(p, std=std)
    return model.eval()


def make_feature(target, kind="eagle", window=0, seed=1, std=0.2, packed=False) -> FeatureDraftModel:
    """packed: prepared as loading prepares it (fused, packed matmuls), so it drafts by the one-call native step."""
    n = target.config.num_hidden_layers
    layers = (n,) if kind == "mtp" else (0, 1, n)
    model = _randomize(FeatureDraftModel(target.config, FeatureConfig(kind, layers, window)), seed, std)
    return model.prepare_inference() if packed else model


def make_medusa(target, heads=3, seed=1, std=0.2) -> MedusaHeads:
    acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]][:heads]
    cfg = MedusaConfig(heads, target.config.num_hidden_layers, sparse_tree(acc, 10))
    return _randomize(MedusaHeads(target.config, cfg), seed, std)


def drafter_for(kind: str, target, tree: TreeConfig, window: int = 0, std: float = 0.2, packed: bool = False):
    if kind == "medusa":
        return MedusaDrafter(make_medusa(target, std=std), target, tree)
    return FeatureDrafter(make_feature(target, kind, window, std=std, packed=packed), target, tree)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, 0.2)


@pytest.fixture(scope="module")
def plain(target):
    return [decode(target, p, GREEDY).token_ids for p in PROMPTS]


@pytest.mark.parametrize("kind,packed", [("eagle", False), ("eagle", True), ("mtp", False), ("mtp", True),
                                         ("medusa", False)])
@pytest.mark.parametrize("shape", list(TREES))
@pytest.mark.parametrize("k", [1, 5])
def test_greedy_equals_plain(kind, packed, shape, k, target, plain):
    """packed: the feature drafters' native step (model.fused.FusedFeature) drafts; else their torch path."""
    for window in ((0, 4) if kind != "medusa" else (0,)):
        for prompt, ref in zip(PROMPTS, plain):
            drafter = drafter_for(kind, target, TREES[shape], window, packed=packed)
            out = decode(target, prompt, GREEDY, drafter=drafter, spec=SpecConfig(k=k))
            assert out.token_ids == ref, (window, prompt)
            assert out.stats.num_drafts > 0 or len(prompt) == 1
            assert drafter.live_sequences() == set()


def test_engine_mixed_chain_tree_and_lookup_requests_equal_plain(target, plain):
    """The engine feeds the drafters' rows from prefill chunks and every verified round, several requests at once,
    with prompt lookup drafting some rounds in front of the eagle drafter (its state stays in sync)."""
    drafters = {"eagle": drafter_for("eagle", target, TreeConfig(), window=4),
                "mtp-tree": drafter_for("mtp", target, TREES["tree"]),
                "medusa-tree": drafter_for("medusa", target, TREES["wide"]),
                "lookup-eagle": LookupFirstDrafter(drafter_for("eagle", target, TreeConfig()), 2, 3)}
    engine = Engine(target, None, EngineConfig(k=6, drafter="eagle", prefill_chunk=5), drafters=drafters)
    ids = []
    for name in drafters:
        for prompt, k in zip(PROMPTS, (6, 3, 4)):
            ids.append(engine.add_request(prompt, GREEDY, RequestSpec(drafter=name, k=k)))
    results = engine.run_until_done()
    for n, i in enumerate(ids):
        assert results[i].token_ids == plain[n % len(PROMPTS)]
    assert drafters["lookup-eagle"].num_lookup > 0 and drafters["lookup-eagle"].num_inner > 0
    engine.check_idle()


def test_training_time_test_drafts_what_inference_drafts(target):
    """ttt_forward's step s at row anchor - 1 + s, fed the drafted tokens, drafts inference's token s + 1."""
    model = make_feature(target, "eagle")
    tokens = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(3))
    p, s = 12, 6
    drafter = FeatureDrafter(model, target)
    _, hidden = target(tokens, hidden_layers=model.config.target_layers)
    drafter.start(0, tokens[0, :p].tolist())
    drafter.observe(0, 0, {k: v[0, : p - 1] for k, v in hidden.items()})
    draft = drafter.propose([DraftRequest(0, tokens[0, :p].tolist(), s, GREEDY, None)])[0]
    seq = tokens.clone()
    seq[0, p : p + s] = torch.tensor(draft.tokens)
    _, hidden = target(seq, hidden_layers=model.config.target_layers)
    with torch.no_grad():
        outs = model.ttt_forward(target.model.embed_tokens, seq, model.features(hidden), s)
        again = [int(model.logits(outs[i][0, p - 2 + i], target.lm_head.weight).argmax()) for i in range(s)]
    assert again == draft.tokens


def _fresh(model, target, tokens: list[int], tree: TreeConfig) -> FeatureDrafter:
    """A drafter (no window) fed the whole committed history in one prefill."""
    fresh = FeatureDrafter(model, target, tree, context_window=0)
    _, hidden = target(torch.tensor([tokens]), hidden_layers=model.config.target_layers)
    fresh.start(1, tokens)
    fresh.observe(1, 0, {k: v[0, :-1] for k, v in hidden.items()})
    return fresh


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("packed", [False, True])
def test_drafter_state_after_rounds_and_rollback_equals_recomputation(window, shape, packed, target):
    """After verified rounds (a tree's accepted branch included) and rollbacks, the drafter's committed entries
    equal those of a drafter that saw the committed tokens in one prefill, at the same positions; without a window
    its next draft is the same too. packed: the caches are written by the native step."""
    model = make_feature(target, "eagle", window, packed=packed)
    drafter = FeatureDrafter(model, target, TREES[shape], context_window=window)
    prompt = PROMPTS[1]
    ref = decode(target, prompt, SamplingParams(max_tokens=30, ignore_eos=True)).token_ids
    tokens = list(prompt)
    drafter.start(0, tokens)
    _, hidden = target(torch.tensor([tokens]), hidden_layers=model.config.target_layers)
    drafter.observe(0, 0, {k: v[0, :-1] for k, v in hidden.items()})
    last = 0
    while len(tokens) < len(prompt) + 24:  # greedy rounds by hand: the deepest path the truth accepts
        draft = drafter.propose([DraftRequest(0, tokens, 5, GREEDY, None)])[0]
        truth = ref[len(tokens) - len(prompt) :]
        accepted = [draft.tokens[i] for i in _accepted_path(draft, truth)]
        committed = [*accepted, truth[len(accepted)]]
        _, hidden = target(torch.tensor([tokens + accepted]), hidden_layers=model.config.target_layers)
        drafter.accept(Verified(0, len(accepted), committed, {k: v[0, len(tokens) - 1 :] for k, v in hidden.items()}))
        tokens, last = tokens + committed, len(committed)
    cuts = [len(tokens), len(tokens) - last - 1] + ([len(prompt) + 3] if not window else [])
    for cut in cuts:
        drafter.rollback(0, cut)
        assert drafter.known(0) == cut - 1
        fresh = _fresh(model, target, tokens[:cut], TREES[shape])
        fresh.calibration = drafter.calibration  # trees ranked alike: what the rounds taught it is not cache state
        mine = drafter.propose([DraftRequest(0, tokens[:cut], 5, GREEDY, None)])[0]
        theirs = fresh.propose([DraftRequest(1, tokens[:cut], 5, GREEDY, None)])[0]
        a, b = drafter._caches[0], fresh._caches[1]
        assert a.next_position == b.next_position == cut - 1
        rows = slice(a.position_offset, a.next_position)
        assert torch.allclose(a.k[:, :, :, : a.length], b.k[:, :, :, rows], atol=1e-5)
        assert torch.allclose(a.v[:, :, :, : a.length], b.v[:, :, :, rows], atol=1e-5)
        if not window:
            assert mine.tokens == theirs.tokens and mine.parents == theirs.parents, cut
        if window:
            assert a.length <= 2 * window


def _accepted_path(draft: Draft, truth: list[int]) -> list[int]:
    """Node indices of the deepest path the greedy truth accepts."""
    path, parent = [], -1
    for token in truth:
        nxt = [i for i, p in enumerate(draft.node_parents) if p == parent and draft.tokens[i] == token]
        if not nxt:
            break
        path.append(nxt[0])
        parent = nxt[0]
    return path


def test_a_tree_holds_its_best_nodes_and_medusa_follows_its_static_paths(target):
    model = make_medusa(target)
    drafter = MedusaDrafter(model, target, TreeConfig("auto", 3, 3, 6))
    tokens = PROMPTS[0]
    _, hidden = target(torch.tensor([tokens]), hidden_layers=(2,))
    drafter.start(0, tokens)
    drafter.observe(0, 0, {2: hidden[2][0, :-1]})
    draft = drafter.propose([DraftRequest(0, tokens, 6, GREEDY, None)])[0]
    assert len(draft.tokens) == 6 and draft.parents is not None
    x = target.model.norm(hidden[2][0, -2])
    ranks = target.lm_head(model.states(x)).argsort(-1, descending=True)  # [K, V]
    paths = [p for p in model.config.tree if max(p) < 3][:6]
    assert draft.tokens == [int(ranks[len(p) - 1, p[-1]]) for p in paths]


N_STAT = 2000


@pytest.fixture(scope="module")
def stat_target():
    return tiny_model(0, 0.25, vocab_size=SV, max_position_embeddings=16, num_hidden_layers=2)


def _engine_samples(drafter, stat_target, k: int = 2) -> tuple[Engine, np.ndarray]:
    engine = Engine(stat_target, None, EngineConfig(k=k, drafter="d", max_running=250, max_queued=N_STAT),
                    drafters={"d": drafter})
    for i in range(N_STAT):
        engine.add_request(S_PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=i), request_id=str(i))
    results = engine.run_until_done()
    return engine, np.array([results[str(i)].token_ids for i in range(N_STAT)])


def _follows_target(samples: np.ndarray, stat_target) -> bool:
    joints = exact_pair_joints(stat_target, S_PROMPT, S_PARAMS)
    for cols, joint in (([0, 1], joints[0]), ([1, 2], joints[1])):
        tv, pval, impossible = check_pair(samples[:, cols], joint)
        if not (tv < tv_limit(SV * SV, N_STAT) and pval > ALPHA and impossible == 0):
            return False
    return True


@pytest.mark.parametrize("kind,shape,packed", [("eagle", "chain", False), ("eagle", "chain", True),
                                               ("mtp", "chain", False), ("mtp", "chain", True),
                                               ("eagle", "wide", False), ("eagle", "wide", True),
                                               ("medusa", "chain", False), ("medusa", "wide", False)])
def test_sampled_output_follows_the_target(kind, shape, packed, stat_target):
    """A5 through the engine: sampled chains (q from the drafter) and trees (point masses, recursive rejection
    sampling) give consecutive output pairs that follow the target's exact joints, on the feature drafters' torch
    path and on their native step (packed)."""
    drafter = drafter_for(kind, stat_target, TREES[shape], std=0.5, packed=packed)
    engine, samples = _engine_samples(drafter, stat_target, k=4 if shape == "wide" else 2)
    assert 0 < engine.metrics.num_accepted_tokens < engine.metrics.num_draft_tokens
    assert _follows_target(samples, stat_target)


class _LyingMedusa(MedusaDrafter):
    """Samples each head's token at temperature 1/3 but reports q at temperature 1: verification then accepts
    the sharpened tokens too often."""

    def propose(self, requests):
        sharp = [DraftRequest(r.seq_id, r.tokens, r.budget, SamplingParams(max_tokens=3, temperature=1 / 3),
                              r.generator) for r in requests]
        honest = super().propose(requests)
        drawn = super().propose(sharp)
        return [Draft.chain(d.tokens, h.probs) if h.probs is not None and len(d.tokens) == len(h.tokens) else h
                for d, h in zip(drawn, honest)]


def test_negative_control_a_drafter_lying_about_q_is_detected(stat_target):
    drafter = _LyingMedusa(make_medusa(stat_target, std=0.5), stat_target)
    _, samples = _engine_samples(drafter, stat_target)
    assert not _follows_target(samples, stat_target)


def test_checkpoints_round_trip_and_fail_clearly(tmp_path, target):
    eagle = make_feature(target, "eagle")
    save_feature_drafter(eagle, tmp_path / "e")
    loaded = load_feature_drafter(tmp_path / "e", target, "eagle")
    for (name, a), b in zip(eagle.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(a.to(torch.bfloat16).float(), b), name
    medusa = make_medusa(target)
    save_medusa(medusa, tmp_path / "m")
    assert load_medusa(tmp_path / "m", target).model.config == medusa.config
    spec = build_drafter(f"eagle(path={tmp_path / 'e'}, tree=auto, nodes=5, window=8)", target=target,
                         dtype=torch.float32, device=torch.device("cpu"))
    assert spec.capabilities.trees and spec.window == 8
    with pytest.raises(CheckpointError, match="not a mtp drafter"):
        load_feature_drafter(tmp_path / "e", target, "mtp")
    with pytest.raises(CheckpointError, match="not a medusa drafter"):
        load_medusa(tmp_path / "e", target)
    with pytest.raises(CheckpointError, match="needs a checkpoint"):
        build_drafter("medusa", target=target, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="no option"):
        build_drafter(f"eagle(path={tmp_path / 'e'}, bogus=1)", target=target, dtype=torch.float32,
                      device=torch.device("cpu"))
    other = tiny_model(0, 0.2, hidden_size=32, head_dim=8)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_feature_drafter(tmp_path / "e", other, "eagle")
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state.pop("heads.0.bias")
    save_file(state, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="heads.0.bias"):
        load_medusa(tmp_path / "m", target)
    state = load_file(str(tmp_path / "e" / "model.safetensors"))
    state["w_in.weight"] = state["w_in.weight"][:, :5].contiguous()
    save_file(state, str(tmp_path / "e" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="w_in.weight has shape"):
        load_feature_drafter(tmp_path / "e", target, "eagle")
    (tmp_path / "e" / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config"):
        load_feature_drafter(tmp_path / "e", target, "eagle")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target and 24 of its own greedy continuations (prompt 8 + 24 tokens)."""
    return tiny_continuations(tmp_path_factory.mktemp("feat"))


def tcfg(kind: str, **kw) -> FeatureTrainConfig:
    # the random target's p is near flat (max ~2%): its greedy tokens carry the signal
    base = dict(kind=kind, ttt_steps=2, num_heads=3, batch_size=4, prompt_len=8, lr=3e-3, warmup_steps=2,
                max_steps=6, context_window=0, hard_weight=0.5)
    return FeatureTrainConfig(**{**base, **kw})


@pytest.mark.parametrize("kind,steps,hard,margin", [("eagle", 60, 0.5, 0.3), ("mtp", 120, 0.5, 0.15),
                                                   ("medusa", 400, 1.0, 0.3)])
def test_training_raises_tau_and_the_result_drafts_losslessly(kind, steps, hard, margin, setup, tmp_path):
    """On a random tiny target MTP, which sees only the last layer, learns slowest, and Medusa's identity start is
    already right on its repetitive continuations: more steps, hard labels, a lower bar where needed."""
    path, target, seqs = setup
    c = tcfg(kind, max_steps=steps, lr=1e-2, warmup_steps=5, hard_weight=hard)
    before = evaluate(c.build(target.config).eval(), path / "target", seqs, c, depth=3, anchors=4)
    model = train_feature_drafter(path / "target", seqs, tmp_path / "r", c, progress=False)
    after = evaluate(model, path / "target", seqs, c, depth=3, anchors=4)
    assert after["tau"] > before["tau"] + margin, (before, after)
    if kind == "medusa":
        finish_medusa(model, after, nodes=8)
        assert len(model.config.tree) == 8
        save_medusa(model, tmp_path / "d")
        drafter = load_medusa(tmp_path / "d", target, TreeConfig("auto", 3, 3, 8))
    else:
        save_feature_drafter(model, tmp_path / "d")
        drafter = load_feature_drafter(tmp_path / "d", target, kind)
    prompt = seqs[0][:8].tolist()
    ref = decode(target, prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    out = decode(target, prompt, SamplingParams(max_tokens=20, ignore_eos=True), drafter=drafter, spec=SpecConfig(k=3))
    assert out.token_ids == ref.token_ids and out.stats.tau > 1.3


def test_resume_continues_exactly(setup, tmp_path):
    path, _, seqs = setup
    c = tcfg("eagle")
    assert train_feature_drafter(path / "target", seqs, tmp_path / "a", c, progress=False, stop_at=3) is None
    a = train_feature_drafter(path / "target", seqs, tmp_path / "a", c, progress=False)
    b = train_feature_drafter(path / "target", seqs, tmp_path / "b", c, progress=False)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert json.loads((tmp_path / "a" / "state" / "meta.json").read_text())["step"] == 6


@pytest.mark.parametrize("kind", ["eagle", "mtp", "medusa"])
def test_loaded_drafters_pack_and_stay_exact_on_a_bf16_target(kind, tmp_path, target):
    """As loaded for serving: on a bf16 target on CPU the drafter computes in fp32 over packed weights; greedy
    output still equals the bf16 target's plain decoding."""
    from verispec.model import load_model

    save_model(target, tmp_path / "t")
    bf16 = load_model(tmp_path / "t", "bf16")
    if kind == "medusa":
        save_medusa(make_medusa(target), tmp_path / "d")
        drafter = load_medusa(tmp_path / "d", bf16)
        assert drafter.model.heads[0].weight.dtype == torch.float32
    else:
        save_feature_drafter(make_feature(target, kind), tmp_path / "d")
        drafter = load_feature_drafter(tmp_path / "d", bf16, kind, TREES["tree"])
        assert drafter.model.dtype == torch.float32 and drafter.model.layer.mlp.gate_up_weight is not None
    for prompt in PROMPTS[:2]:
        ref = decode(bf16, prompt, GREEDY).token_ids
        assert decode(bf16, prompt, GREEDY, drafter=drafter, spec=SpecConfig(k=4)).token_ids == ref


def test_requests_choose_their_tree_shape(target, plain):
    """A tree asked per request (SpecConfig.tree in decode, RequestSpec.tree in the engine) of drafters whose spec
    drafts chains: their drafts become trees, chain and tree requests share one drafter and one step, and every
    output equals plain greedy decoding; a chains-only drafter refuses a tree request."""
    shape = TreeConfig("auto", 2, 3, 6)
    for kind in ("eagle", "mtp", "medusa"):
        drafter = drafter_for(kind, target, TreeConfig())
        assert not drafter.capabilities.trees and drafter.capabilities.tree_requests
        seen = []
        inner_propose = drafter.propose

        def spy(requests, inner_propose=inner_propose, seen=seen):
            drafts = inner_propose(requests)
            seen.extend(not d.is_chain for d in drafts)
            return drafts

        drafter.propose = spy
        out = decode(target, PROMPTS[0], GREEDY, drafter=drafter, spec=SpecConfig(k=6, tree=shape))
        assert out.token_ids == plain[0] and any(seen), kind
    drafters = {"e": drafter_for("eagle", target, TreeConfig()), "m": ModelDrafter(tiny_model(123, 0.5), TreeConfig())}
    engine = Engine(target, None, EngineConfig(k=6, drafter="e", prefill_chunk=5), drafters=drafters)
    ids = [engine.add_request(p, GREEDY, RequestSpec(drafter=d, tree=t))
           for d in ("e", "m") for p in PROMPTS for t in (None, shape)]
    results = engine.run_until_done()
    for n, i in enumerate(ids):
        assert results[i].token_ids == plain[(n // 2) % len(PROMPTS)]
    with pytest.raises(ConfigError, match="chains only"):
        engine.add_request(PROMPTS[0], GREEDY, RequestSpec(drafter="ngram", tree=shape))
    with pytest.raises(ConfigError, match="chains only"):
        decode(target, PROMPTS[0], GREEDY, drafter=build_drafter("ngram", target=target, dtype=torch.float32,
                                                                  device=torch.device("cpu")),
               spec=SpecConfig(k=4, tree=shape))


def test_the_server_parses_a_requests_tree():
    from verispec.serve.protocol import APIError, parse_speculation

    assert parse_speculation({"method": "eagle", "tree": "auto"}).tree == TreeConfig("auto")
    spec = parse_speculation({"tree": {"width": 2, "depth": 6, "nodes": 12}, "k": 12})
    assert spec.tree == TreeConfig("auto", 2, 6, 12)
    assert parse_speculation({"k": 4}).tree is None
    for bad in ("deep", {"width": 0}, {"nodes": 99}, {"shape": 1}, {"mode": "sideways"}, 3):
        with pytest.raises(APIError) as e:
            parse_speculation({"tree": bad})
        assert e.value.status == 400 and "tree" in e.value.param


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
def test_batched_chain_proposals_equal_one_at_a_time(kind, target):
    """Requests with different context lengths and budgets in one packed proposal draft what each drafts alone,
    and leave the same committed entries."""
    model = make_feature(target, kind, window=6)
    together, alone = FeatureDrafter(model, target), FeatureDrafter(model, target)
    requests = []
    for sid, prompt in enumerate(PROMPTS[:2] + [PROMPTS[0][:9], list(range(20, 40))]):
        _, hidden = target(torch.tensor([prompt]), hidden_layers=model.config.target_layers)
        for d in (together, alone):
            d.start(sid, prompt)
            d.observe(sid, 0, {k: v[0, :-1] for k, v in hidden.items()})
        requests.append(DraftRequest(sid, prompt, (5, 3, 1, 6)[sid], GREEDY, None))
    batched = together.propose(requests)
    for r, d in zip(requests, batched):
        single = alone.propose([r])[0]
        assert d.tokens == single.tokens and len(d.tokens) == r.budget
        assert torch.allclose(d.confidence, single.confidence, atol=1e-5)
        a, b = together._caches[r.seq_id], alone._caches[r.seq_id]
        assert a.length == b.length and a.position_offset == b.position_offset
        assert torch.allclose(a.k[:, :, :, : a.length], b.k[:, :, :, : b.length], atol=1e-5)
