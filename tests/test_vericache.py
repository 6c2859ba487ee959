"""The vericache drafter (drafters/vericache.py): the target drafting for itself over a compressed view of its own
KV cache, alone or over an inner drafter. Greedy output equals plain decoding for every compressor, horizon and
inner drafter, in decode and in the engine (chunked prefill, mixed batches), fp32 and bf16 on the native path;
sampling follows the target's distribution (the position-pairwise test of test_exactness, with negative controls
that lie about q); specs parse, build and fail clearly; inner drafters roll back exactly; state is freed; and the
adaptive horizon chooses as its cost model says."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _checkpoints import edited_copy
from _markov import tv_limit
from conftest import no_native_reason, tiny_model
from test_block_drafter import make_block
from test_engine import run_checked
from test_exactness import S_PARAMS, S_PROMPT, SV, exact_pair_joints, failures, sample_runs

from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import (
    BlockDrafter, Draft, DraftRequest, LookupFirstDrafter, ModelDrafter, NgramDrafter, VeriCacheDrafter, Verified,
    build_drafter,
)
from verispec.drafters.vericache import Horizon
from verispec.engine import Engine
from verispec.errors import CheckpointError, ConfigError
from verispec.kernels import native
from verispec.model import save_model

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
_g = torch.Generator().manual_seed(11)
PROMPTS = {
    "free": torch.randint(0, 97, (64,), generator=_g).tolist(),
    "repeat": torch.randint(0, 97, (12,), generator=_g).tolist() * 4,  # prompt lookup and ngram hit here
    "long": torch.randint(0, 97, (90,), generator=_g).tolist(),
}
# Budgets far below the prompts (40-90 tokens), so every view evicts (KIVI alone quantizes instead).
COMPRESSORS = {
    "streaming": dict(compress="streaming", budget=12),
    "snapkv": dict(compress="snapkv", budget=16, recent=8, window=4),
    "retrieval": dict(compress="retrieval", budget=16),
    "kivi": dict(compress="kivi", budget=16, group=8, residual=4),
    "streaming+kivi": dict(compress="streaming+kivi", budget=16, group=4, residual=4, bits=4),
    "snapkv+kivi": dict(compress="snapkv+kivi", budget=20, recent=8, window=4, group=4, residual=4),
}


def spec_of(comp: str, horizon: str = "fixed", draft: str | None = None, **extra) -> str:
    opts = {**COMPRESSORS[comp], "horizon": horizon, **extra}
    if draft is not None:
        opts["draft"] = draft
    return "vericache(" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")"


def compressor_args(comp: str) -> dict:
    opts = {k: str(v) for k, v in COMPRESSORS[comp].items()}
    return {"name": opts.pop("compress"), "budget": int(opts.pop("budget")), **opts}


def record_views(drafter: VeriCacheDrafter) -> list:
    """Every CompressedView the drafter makes (it frees them at finish): [(seq_id, view)]."""
    views = []
    attach = drafter.attach_cache

    def spy(seq_id, cache):
        attach(seq_id, cache)
        views.append((seq_id, drafter._seqs[seq_id].view))

    drafter.attach_cache = spy
    return views


def compressed(view) -> bool:
    """The view really holds less than the full cache: rows evicted, or (KIVI alone) rows quantized."""
    quantizer = getattr(view.compressor, "quantizer", view.compressor)
    return view.cache.position_offset > 0 or getattr(quantizer, "quantized_rows", 0) > 0


@pytest.fixture(scope="module")
def target():
    return tiny_model(2, 0.5)  # diverse outputs: drafts get rejected


@pytest.fixture(scope="module")
def plain(target):
    return {name: decode(target, p, GREEDY).token_ids for name, p in PROMPTS.items()}


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("vc-draft")
    save_model(tiny_model(5, 0.5), d)
    return d


def make_vericache(target, comp: str, horizon: str, inner: str | None, draft_dir) -> VeriCacheDrafter:
    if inner == "block":  # no spec for a tiny block drafter without a checkpoint: built directly
        block = BlockDrafter(make_block(target, head="markov", confidence=True), target)
        return VeriCacheDrafter(target, compressor_args(comp), block, adaptive=horizon == "adaptive")
    draft = {None: None, "ngram": "ngram", "model": f"model:{draft_dir}", "lookup": f"lookup:model:{draft_dir}"}[inner]
    d = build_drafter(spec_of(comp, horizon, draft), target=target, dtype=torch.float32, device=CPU)
    assert isinstance(d, VeriCacheDrafter) and d.adaptive == (horizon == "adaptive")
    return d


def test_references_are_not_degenerate(plain):
    assert all(len(set(toks)) >= 8 for name, toks in plain.items() if name != "repeat")


# ---- greedy exactness in decode -------------------------------------------------------------------------------

@pytest.mark.parametrize("inner", [None, "ngram", "model", "lookup", "block"])
@pytest.mark.parametrize("horizon", ["fixed", "adaptive"])
@pytest.mark.parametrize("comp", list(COMPRESSORS))
def test_greedy_equals_plain(comp, horizon, inner, target, plain, draft_dir):
    drafter = make_vericache(target, comp, horizon, inner, draft_dir)
    views = record_views(drafter)
    drafted = accepted = 0
    for name in ("free", "repeat"):
        res = decode(target, PROMPTS[name], GREEDY, drafter=drafter, spec=SpecConfig(k=5))
        assert res.token_ids == plain[name], name
        view = views[-1][1]
        assert compressed(view), name
        assert view.cache.length <= view.compressor.budget or comp == "kivi", name  # KIVI quantizes, never evicts
        assert drafter.live_sequences() == set()
        drafted += res.stats.num_draft_tokens
        accepted += res.stats.num_accepted_tokens
    assert drafted > 0
    if horizon == "fixed":
        assert accepted > 0 and drafter.stats["drafted"] >= drafted
        if inner is not None:
            assert drafter.stats["inner_rounds"] > 0


def test_lookup_over_vericache_equals_plain(target, plain):
    """vericache as a lookup drafter's inner one: the cache is lent through lookup (attach_cache)."""
    drafter = build_drafter("lookup:vericache:streaming:12", target=target, dtype=torch.float32, device=CPU)
    assert isinstance(drafter, LookupFirstDrafter) and drafter.capabilities.reads_target_kv
    views = record_views(drafter.inner)
    for name in ("free", "repeat"):
        assert decode(target, PROMPTS[name], GREEDY, drafter=drafter, spec=SpecConfig(k=4)).token_ids == plain[name]
        assert views[-1][1].cache.position_offset > 0
    assert drafter.num_lookup > 0 and drafter.num_inner > 0 and drafter.live_sequences() == set()


def test_snapkv_scores_with_its_own_window(target, monkeypatch):
    """SnapKV's observation window (`window=`) is the number of prompt queries it scores with, composed with KIVI or
    not."""
    import verispec.cache.compress as compress

    seen = []
    real = compress.top_positions
    monkeypatch.setattr(compress, "top_positions", lambda q, *a: seen.append(q.shape[2]) or real(q, *a))
    for comp in ("snapkv", "snapkv+kivi"):
        seen.clear()
        drafter = build_drafter(spec_of(comp), target=target, dtype=torch.float32, device=CPU)
        decode(target, PROMPTS["free"], GREEDY, drafter=drafter, spec=SpecConfig(k=4))
        assert seen and set(seen) == {COMPRESSORS[comp]["window"]}, comp


# ---- greedy exactness in the engine ---------------------------------------------------------------------------

def test_engine_greedy_equals_plain(target, plain, draft_dir):
    """Every compressor, next to each other and to requests with other drafters and none; prompts longer than
    the prefill chunk, staggered arrivals."""
    block = BlockDrafter(make_block(target, head="markov", confidence=True), target)
    vc_block = VeriCacheDrafter(target, compressor_args("streaming+kivi"), block, adaptive=False)
    engine = Engine(target, None, EngineConfig(k=4, prefill_chunk=24, drafter=None),
                    drafters={"vc-block": vc_block, "self": ModelDrafter(target)})
    inners = [None, "ngram", f"model:{draft_dir}", f"lookup:model:{draft_dir}"]
    specs = [spec_of(comp, ("fixed", "adaptive")[i % 2], inners[i % 4]) for i, comp in enumerate(COMPRESSORS)]
    specs += ["vc-block", "ngram", "self", "none", spec_of("snapkv", "fixed", "ngram")]
    recorded = [record_views(engine.drafter(spec)) for spec in set(specs) - {"none", "ngram", "self"}]
    names = list(PROMPTS)
    arrivals: dict[int, list[tuple]] = {}
    for i, spec in enumerate(specs):
        arrivals.setdefault(2 * (i // 3), []).append(
            (PROMPTS[names[i % 3]], GREEDY, RequestSpec(drafter=spec, k=(4, 6, 3)[i % 3]), f"r{i}"))
    results = run_checked(engine, arrivals)
    for i, spec in enumerate(specs):
        assert results[f"r{i}"].token_ids == plain[names[i % 3]], f"request {i} ({spec})"
    views = [view for r in recorded for _, view in r]
    assert len(views) == len(specs) - 3 and all(compressed(v) for v in views)
    assert engine.metrics.num_accepted_tokens > 0
    engine.check_idle()


def test_engine_sampled_requests_stay_valid(target):
    """Sampled vericache requests in a batch, prompts over several prefill chunks: they finish with in-vocabulary
    tokens and free their state."""
    engine = Engine(target, None, EngineConfig(k=4, prefill_chunk=32, drafter=spec_of("streaming", draft="ngram")))
    for i, name in enumerate(PROMPTS):
        engine.add_request(PROMPTS[name], SamplingParams(max_tokens=20, temperature=0.9, seed=i, ignore_eos=True),
                           request_id=name)
    results = engine.run_until_done()
    assert all(len(r.token_ids) == 20 and all(0 <= t < 97 for t in r.token_ids) for r in results.values())
    engine.check_idle()


@pytest.mark.parametrize("chunk", [512, 24])
def test_engine_never_prefills_the_prompt_twice(chunk, target, plain):
    """The view follows the rows the target's own forwards wrote ("no round prefills twice"): in the engine as in
    decode, each drafter forward over the view feeds the anchor (or the last committed token) and its inner draft,
    never the prompt rows the same step is prefilling."""
    spec = spec_of("streaming", draft="ngram")
    fed = {"engine": [], "decode": []}
    forward = target.forward
    where = []

    def spy(tokens, positions=None, cache=None, hidden_layers=(), num_logits=None, **kw):
        if cache is not None and cache.max_len == 12 + 512:  # a view (budget 12, headroom 512), not a full cache
            fed[where[-1]].append(tokens.shape[1])
        return forward(tokens, positions=positions, cache=cache, hidden_layers=hidden_layers, num_logits=num_logits,
                       **kw)

    target.forward = spy
    try:
        where.append("decode")
        drafter = build_drafter(spec, target=target, dtype=torch.float32, device=CPU)
        assert decode(target, PROMPTS["long"], GREEDY, drafter=drafter, spec=SpecConfig(k=4)).token_ids == plain["long"]
        where.append("engine")
        engine = Engine(target, None, EngineConfig(k=4, prefill_chunk=chunk, drafter=spec))
        engine.add_request(PROMPTS["long"], GREEDY, request_id="r")
        assert engine.run_until_done()["r"].token_ids == plain["long"]
    finally:
        del target.forward
    inner_k = 4  # the most an inner round drafts here (the budget k)
    assert fed["decode"] and max(fed["decode"]) <= 1 + inner_k
    assert fed["engine"] and max(fed["engine"]) <= 1 + inner_k, fed["engine"][:3]


def test_engine_samples_from_the_target(stat_models):
    """N seeded requests through one engine, 250 at a time, k=1 and 4 tokens each: the step that prefills the
    prompt drafts nothing (the view syncs from the cached prompt; the engine never lets it prefill again), later
    rounds draft over the compressed view (2 rows of 6); the pairwise test of test_exactness passes on (x1, x2) and
    (x2, x3)."""
    target, _ = stat_models
    n = 2000
    engine = Engine(target, None, EngineConfig(k=1, drafter="vc", max_running=250, max_queued=n), drafters={
        "vc": VeriCacheDrafter(target, {"name": "streaming", "budget": 2}, adaptive=False)})
    for i in range(n):
        engine.add_request(S_PROMPT, SamplingParams(max_tokens=4, temperature=1.0, seed=i), request_id=str(i))
    results = engine.run_until_done()
    samples = np.array([results[str(i)].token_ids[:3] for i in range(n)])
    assert failures(samples, exact_pair_joints(target, S_PROMPT, S_PARAMS)) == []
    m = engine.metrics
    assert m.num_drafts >= n * 0.9 and m.num_accepted_tokens < m.num_draft_tokens  # compressed drafts rejected
    engine.check_idle()


def test_kivi_view_holds_a_context_longer_than_its_headroom():
    """KIVI quantizes and never evicts, so its view must hold the whole context: a 600-token prompt with
    `vericache:kivi:16` (a view made for 16 rows plus its headroom of 512) decodes as plainly as with the other
    compressors."""
    target = tiny_model(2, 0.5, max_position_embeddings=1024)
    prompt = torch.randint(0, 97, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = decode(target, prompt, params).token_ids
    for spec in ("vericache:streaming:16", "vericache:kivi:16"):
        drafter = build_drafter(spec, target=target, dtype=torch.float32, device=CPU)
        assert decode(target, prompt, params, drafter=drafter, spec=SpecConfig(k=4)).token_ids == plain, spec


# ---- bf16 on the native path ----------------------------------------------------------------------------------

@pytest.mark.skipif(not native.available(), reason=no_native_reason())
@pytest.mark.parametrize("comp", ["streaming", "snapkv", "streaming+kivi"])
def test_bf16_native_greedy_equals_plain(comp, draft_dir):
    target = tiny_model(2, 0.5).to(torch.bfloat16).pack_weights()
    with torch.inference_mode():
        assert target.forward_path == "native"
    plain = {name: decode(target, PROMPTS[name], GREEDY).token_ids for name in ("free", "repeat")}
    caches = []
    fused = target.fused.forward
    target.fused.forward = lambda tokens, cache, *a: caches.append(cache) or fused(tokens, cache, *a)
    for inner in (None, "ngram"):
        drafter = build_drafter(spec_of(comp, draft=inner), target=target, dtype=torch.bfloat16, device=CPU)
        views = record_views(drafter)
        for name in ("free", "repeat"):
            caches.clear()
            assert decode(target, PROMPTS[name], GREEDY, drafter=drafter, spec=SpecConfig(k=4)).token_ids == plain[name]
            view = views[-1][1]
            assert view.cache.position_offset > 0
            assert any(c is view.cache for c in caches), "the drafter's forwards did not run natively"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_greedy_requests_draft_in_lockstep(dtype):
    """Greedy requests sharing one vericache drafter (no inner drafter) draft together, one packed forward a step
    over every view, arriving at different steps (views of different lengths and positions, some requests still
    prefilling): the outputs equal plain decoding, and the lockstep path did draft for all of them at once."""
    if dtype == "bf16" and not native.available():
        pytest.skip(no_native_reason())
    target = tiny_model(2, 0.5)
    if dtype == "bf16":
        target = target.to(torch.bfloat16).pack_weights()
    plain = {name: decode(target, p, GREEDY).token_ids for name, p in PROMPTS.items()}
    for comp in ("streaming", "snapkv", "retrieval", "snapkv+kivi"):
        spec = spec_of(comp, "adaptive" if comp == "retrieval" else "fixed")
        engine = Engine(target, None, EngineConfig(k=5, prefill_chunk=32, drafter=spec))
        drafter = engine.drafter(spec)
        widths = []
        together = drafter._propose_greedy_together
        drafter._propose_greedy_together = lambda requests: widths.append(len(requests)) or together(requests)
        arrivals = {2 * i: [(PROMPTS[name], GREEDY, RequestSpec(), name)] for i, name in enumerate(PROMPTS)}
        results = run_checked(engine, arrivals)
        assert {name: results[name].token_ids for name in PROMPTS} == plain, comp
        assert widths and max(widths) == len(PROMPTS), (comp, widths)
        engine.check_idle()


# ---- sampling -------------------------------------------------------------------------------------------------

S_N = 2500  # runs per case, as test_exactness (TV limit 0.128)


@pytest.fixture(scope="module")
def stat_models():
    cfg = {"vocab_size": SV, "max_position_embeddings": 16, "num_hidden_layers": 1}
    return tiny_model(0, 0.25, **cfg), tiny_model(1, 0.25, **cfg)


STAT_CASES = {  # (compressor args, inner drafter): budgets of 2-3 rows for a 5-token prompt
    "streaming": ({"name": "streaming", "budget": 2}, None),
    "streaming/model": ({"name": "streaming", "budget": 2}, "model"),
    "kivi2/ngram": ({"name": "kivi", "budget": 8, "bits": "2", "group": "1", "residual": "0"}, "ngram"),
}


def _stat_drafter(cls, target, draft, case: str):
    comp, inner = STAT_CASES[case]
    inner_d = {None: None, "model": lambda: ModelDrafter(draft), "ngram": NgramDrafter}[inner]
    return cls(target, comp, inner_d() if inner_d else None, adaptive=False)


class _FirstQ(VeriCacheDrafter):
    """Records its first proposal's q rows and view."""

    first: torch.Tensor | None = None

    def propose(self, requests):
        out = super().propose(requests)
        if self.first is None and out[0].probs is not None:
            self.first = out[0].probs
            self.view = self._seqs[requests[0].seq_id].view
        return out


def test_statistical_setup_is_informative(stat_models):
    """Guard: the compressed view drafts from a distribution far from the target's (its first q row is not p(x1)),
    so the statistical test sees rejections, and the view really dropped rows."""
    target, draft = stat_models
    p1 = exact_pair_joints(target, S_PROMPT, S_PARAMS)[0].sum(1)
    for case in ("streaming", "kivi2/ngram"):
        d = _stat_drafter(_FirstQ, target, draft, case)
        decode(target, S_PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=0), drafter=d,
               spec=SpecConfig(k=2))
        assert 0.5 * np.abs(d.first[0].double().numpy() - p1).sum() > 0.05, case
        assert compressed(d.view)


@pytest.mark.parametrize("case", list(STAT_CASES))
def test_sampling_follows_the_target(case, stat_models):
    target, draft = stat_models
    samples = sample_runs(target, lambda: _stat_drafter(VeriCacheDrafter, target, draft, case), S_N)
    assert failures(samples, exact_pair_joints(target, S_PROMPT, S_PARAMS)) == []


class _UniformQ(VeriCacheDrafter):
    """Broken: drafts from the compressed model but reports uniform q rows."""

    def propose(self, requests):
        return [Draft.chain(d.tokens, None if d.probs is None else torch.full_like(d.probs, 1 / d.probs.shape[1]))
                for d in super().propose(requests)]


class _ShiftedQ(VeriCacheDrafter):
    """Broken: reports each drafted token's q row at the wrong position (rows rotated by one)."""

    def propose(self, requests):
        return [Draft.chain(d.tokens, None if d.probs is None else d.probs.roll(1, 0))
                for d in super().propose(requests)]


@pytest.mark.parametrize("cls", [_UniformQ, _ShiftedQ])
@pytest.mark.parametrize("case", ["streaming", "streaming/model"])
def test_sampling_check_detects_wrong_q_rows(cls, case, stat_models):
    """Negative controls: the same test, the same runs, with q rows that are not what the tokens were drawn from."""
    target, draft = stat_models
    samples = sample_runs(target, lambda: _stat_drafter(cls, target, draft, case), S_N)
    assert failures(samples, exact_pair_joints(target, S_PROMPT, S_PARAMS)) != []
    assert tv_limit(SV * SV, S_N) < 0.13


# ---- specs ----------------------------------------------------------------------------------------------------

def _build(spec: str, target):
    return build_drafter(spec, target=target, dtype=torch.float32, device=CPU)


def test_specs_parse_and_build(target, draft_dir, plain):
    d = _build("vericache", target)
    assert isinstance(d, VeriCacheDrafter) and d.budget == 256 and d.inner is None and d.adaptive
    assert d.make_compressor().name == "streaming" and d.capabilities.reads_target_kv
    d = _build("vericache:streaming:64", target)
    assert d.budget == 64 and d.make_compressor().name == "streaming"
    d = _build("vericache:kivi", target)
    assert d.make_compressor().name == "kivi"
    d = _build("vericache(compress=snapkv, budget=64, draft=lookup:model)", target)
    assert d.budget == 64 and d.make_compressor().name == "snapkv"
    assert isinstance(d.inner, LookupFirstDrafter) and isinstance(d.inner.inner, ModelDrafter)
    assert d.inner.inner.model is target and d.capabilities.hidden_layers == (0, 1)  # snapkv's queries
    d = _build(f" vericache ( compress = streaming+kivi , budget = 24 , draft = lookup:model:{draft_dir} , "
               f"horizon = fixed , sinks = 2 , bits = 8 , inner_k = 3 ) ", target)
    c = d.make_compressor()
    assert (c.name, c.budget, c.evictor.sinks, c.quantizer.bits) == ("streaming+kivi", 24, 2, 8)
    assert not d.adaptive and d.inner_k == 3 and d.inner.inner.model is not target
    # The same target's weights from a checkpoint: a separate model, drafting exactly as well.
    src = draft_dir.parent / "vc-own"
    save_model(target, src)
    d = _build(f"vericache(compress=streaming, budget=12, weights={src}, horizon=fixed)", target)
    assert d.model is not target
    assert decode(target, PROMPTS["free"], GREEDY, drafter=d, spec=SpecConfig(k=4)).token_ids == plain["free"]


@pytest.mark.parametrize("spec,match", [
    ("vericache(compress=streaming, budget=16", r"\)"),
    ("vericache(budget=16))", "unbalanced"),
    ("vericache(draft=lookup:model(x=1, budget=16)", "unbalanced"),
    ("vericache(budget=16, budget=24)", "twice"),
    ("vericache(bugdet=16)", "bugdet"),
    ("vericache(budget=lots)", "budget"),
    ("vericache(budget=16.5)", "budget"),
    ("vericache(draft)", "key=value"),
    ("vericache(budget=)", "key=value"),
    ("vericache(compress=lru)", "lru"),
    ("vericache:lru:32", "lru"),
    ("vericache(compress=retrieval+kivi)", "retrieval"),
    ("vericache(compress=streaming, bits=4)", "bits"),
    ("vericache(horizon=sometimes)", "horizon"),
    ("vericache(inner_k=many)", "inner_k"),
    ("vericache(budget=0)", "budget"),
    ("vericache(draft=vericache)", "itself"),
    ("vericache(draft=vericache:kivi:16)", "itself"),
    ("vericache(draft= vericache(compress=kivi))", "itself"),
    ("vericache(draft=ngram(x=1))", "no options"),
    ("vericache(draft=nope)", "nope"),
    ("ngram(x=1)", "no options"),
    ("ngram()", "no options"),
    ("vericache(sinks=x)", "sinks"),
    ("vericache(draft=lookup:vericache:streaming:16)", "vericache"),
])
def test_bad_specs_raise_config_error(spec, match, target):
    with pytest.raises(ConfigError, match=match):
        _build(spec, target)


def test_an_inner_tree_drafter_is_refused(target, draft_dir):
    """The compressed model verifies its inner drafter's proposals as chains: a tree-drafting inner drafter is a
    ConfigError naming the fix, and the same drafter with trees off composes."""
    with pytest.raises(ConfigError, match="tree=off"):
        _build(f"vericache(compress=streaming, budget=12, draft=model(path={draft_dir}, tree=auto))", target)
    _build(f"vericache(compress=streaming, budget=12, draft=model(path={draft_dir}, tree=off))", target)


def test_shorthand_over_a_structured_spec_builds(target, plain):
    """`name:ARG` whose ARG is a structured spec (`lookup:vericache(compress=..., budget=...)`): the parentheses are
    the argument's, not options given to lookup."""
    drafter = _build("lookup:vericache(compress=streaming, budget=12)", target)
    assert isinstance(drafter, LookupFirstDrafter) and isinstance(drafter.inner, VeriCacheDrafter)
    assert drafter.inner.budget == 12
    assert decode(target, PROMPTS["repeat"], GREEDY, drafter=drafter, spec=SpecConfig(k=4)).token_ids == plain["repeat"]


def test_weights_of_another_architecture_are_refused(target, tmp_path):
    src = tmp_path / "target"
    save_model(target, src)

    def one_layer(cfg: dict, state: dict) -> None:
        cfg["num_hidden_layers"] = 1
        for name in [n for n in state if n.startswith("model.layers.1.")]:
            del state[name]

    other = edited_copy(src, tmp_path / "one-layer", one_layer)
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        _build(f"vericache(weights={other})", target)
    _build(f"vericache(weights={src})", target)  # the unedited copy loads


# ---- rollback of inner drafters -------------------------------------------------------------------------------

def _rounds(drafter, seq_id: int, tokens: list[int], hidden=None) -> list[int]:
    """Three rounds of proposals, each accepted in part (the second token replaced), as an outer drafter's inner
    rounds would leave it; returns the committed tokens."""
    for _ in range(3):
        d = drafter.propose([DraftRequest(seq_id, tokens, 4, GREEDY, None)])[0]
        a = min(2, len(d.tokens))
        committed = d.tokens[:a] + [(d.tokens[a] + 1) % 97 if len(d.tokens) > a else 3]
        rows = {} if hidden is None else {
            k: h[len(tokens) - 1 : len(tokens) + a] for k, h in hidden(tokens + committed).items()}
        drafter.accept(Verified(seq_id, a, committed, rows))
        tokens = tokens + committed
    return tokens


ALT = [9, 41, 77, 2, 60]


@pytest.mark.parametrize("cut", [21, 24, 27])
def test_model_drafter_rollback_equals_a_fresh_one(cut):
    model = tiny_model(5, 0.5)
    prompt = PROMPTS["free"][:20]
    rolled = ModelDrafter(model)
    rolled.start(0, prompt)
    history = _rounds(rolled, 0, prompt)
    assert len(history) > cut
    rolled.rollback(0, cut)
    for tokens in (history[:cut], history[:cut] + ALT):  # the kept prefix, then text the rolled-back one never saw
        fresh = ModelDrafter(model)
        fresh.start(1, tokens)
        want = fresh.propose([DraftRequest(1, tokens, 5, GREEDY, None)])[0].tokens
        assert rolled.propose([DraftRequest(0, tokens, 5, GREEDY, None)])[0].tokens == want
        rolled.rollback(0, cut)
    if cut < 27:  # power: without the rollback the stale entries show (or the drafter has nothing to feed)
        stale = ModelDrafter(model)
        stale.start(0, prompt)
        _rounds(stale, 0, prompt)
        try:
            got = stale.propose([DraftRequest(0, history[:cut] + ALT, 5, GREEDY, None)])[0].tokens
        except ValueError:
            got = None
        assert got != want


@pytest.mark.parametrize("cut", [21, 24, 27])
def test_block_drafter_rollback_equals_a_fresh_one(cut, target):
    block = make_block(target, head="markov", confidence=True)

    @torch.inference_mode()
    def hidden(tokens: list[int]) -> dict[int, torch.Tensor]:  # the target's rows at every position
        _, h = target(torch.tensor([tokens]), hidden_layers=(1,))
        return {1: h[1][0]}

    prompt = PROMPTS["free"][:20]
    rolled = BlockDrafter(block, target)
    rolled.start(0, prompt)
    rolled.observe(0, 0, {1: hidden(prompt)[1][:-1]})
    history = _rounds(rolled, 0, prompt, hidden)
    assert len(history) > cut and rolled.context_length(0) == len(history) - 1
    for tokens in (history[:cut], history[:cut] + ALT):
        rolled.rollback(0, cut)
        assert rolled.context_length(0) == cut - 1
        if len(tokens) > cut:  # the target's rows for the new text come through observe
            rolled.observe(0, cut - 1, {1: hidden(tokens)[1][cut - 1 : -1]})
        fresh = BlockDrafter(block, target)
        fresh.start(1, tokens)
        fresh.observe(1, 0, {1: hidden(tokens)[1][:-1]})
        want = fresh.propose([DraftRequest(1, tokens, 4, GREEDY, None)])[0].tokens
        assert rolled.propose([DraftRequest(0, tokens, 4, GREEDY, None)])[0].tokens == want
    rolled.finish(0)
    assert rolled.live_sequences() == set()


# ---- the adaptive horizon -------------------------------------------------------------------------------------

def test_horizon_drafts_long_when_drafts_are_cheap_and_accepted():
    h = Horizon()
    assert h.choose(8) == 8  # nothing measured yet: the whole budget
    for _ in range(20):
        h.record(8, 8, draft_s=8 * 1e-4, verify_s=0.010 + 0.0005 * 9)
    assert h.acceptance > 0.99 and h.draft_s == pytest.approx(1e-4)
    assert h.choose(8) == 8 and h.choose(16) == 16
    for _ in range(10):  # every round rejected at its first token
        h.record(8, 0, draft_s=8 * 1e-4, verify_s=0.010 + 0.0005 * 9)
    assert h.acceptance < 0.3 and h.rounds % h.probe_every and 0 < h.choose(8) <= 2
    assert Horizon(adaptive=False).choose(7) == 7


def test_horizon_skips_drafting_that_costs_more_than_a_plain_step():
    h = Horizon()
    for rounds in range(1, 20):
        h.record(2, 2, draft_s=2 * 0.05, verify_s=0.01)  # 50 ms a drafted token, 10 ms a verification
        n = h.choose(8)
        assert (n > 0) == (rounds % h.probe_every == 0), rounds
        if n:
            assert n == 1  # a probe drafts the cheapest length
    cheap = Horizon()
    for _ in range(3):
        cheap.record(2, 2, draft_s=2 * 0.001, verify_s=0.01)
    assert cheap.choose(8) > 0


def test_horizon_verify_cost_fit():
    h = Horizon()
    assert h.verify_s(5) == 0.0
    for _ in range(4):
        h.record(0, 0, 0.0, 0.010)  # a plain step: 1 row
        h.record(4, 4, 0.001, 0.014)  # 5 rows
    assert h.verify_s(1) == pytest.approx(0.010) and h.verify_s(5) == pytest.approx(0.014)
    assert h.verify_s(9) == pytest.approx(0.018) and h.verify_s(3) == pytest.approx(0.012)
    for _ in range(16):  # the context grew: the fit follows the latest 16 rounds only
        h.record(0, 0, 0.0, 0.020)
        h.record(4, 4, 0.001, 0.030)
    assert h.verify_s(1) == pytest.approx(0.020) and h.verify_s(9) == pytest.approx(0.040)
    one = Horizon()
    one.record(8, 8, 0.001, 0.02)  # one row count (9): a step whose fixed part is half its cost
    assert one.verify_s(9) == pytest.approx(0.02) and one.verify_s(0) == pytest.approx(0.01)
    flat = Horizon()
    flat.record(0, 0, 0.0, 0.02)
    flat.record(4, 4, 0.001, 0.01)  # noise: more rows measured cheaper; the slope stays at the step's shape
    assert flat.verify_s(20) == pytest.approx(0.015 + 0.015 / 12 * 17) and flat.verify_s(1) == pytest.approx(0.0125)


def test_a_byte_budget_is_the_tokens_whose_keys_and_values_fit():
    target = tiny_model()
    cfg = target.config
    per_token = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 2  # fp32 keys and values
    d = build_drafter(f"vericache(compress=streaming, budget_bytes={per_token * 24 + per_token // 2})", target=target,
                      dtype=target.dtype, device=target.device)
    assert d.budget == 24
    with pytest.raises(ConfigError, match="not both"):
        build_drafter(f"vericache(budget=8, budget_bytes={per_token * 24})", target=target, dtype=target.dtype,
                      device=target.device)
