"""Block drafters (parallel and DSpark) with random weights: exact whatever they propose, their incremental
context equals a from-scratch recomputation, and their checkpoints load or fail clearly."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _markov import tv_limit
from conftest import no_native_reason, tiny_model
from test_exactness import ALPHA, S_PARAMS, S_PROMPT, SV, check_pair, exact_pair_joints

from verispec.config import EngineConfig, RequestSpec, SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import DraftRequest, Verified, build_drafter
from verispec.drafters.block import BlockDrafter, load_block_drafter, save_block_drafter
from verispec.engine import Engine
from verispec.errors import CheckpointError, ConfigError
from verispec.kernels import native
from verispec.model import load_model, save_model
from verispec.model.block import BlockConfig, BlockDraftModel
from verispec.quant.drafter import PROJECTIONS
from verispec.quant.linear import QuantLinear
from verispec.quant.rtn import quantize_rtn
from verispec.quant.scheme import QuantScheme

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 44, 17, 90, 2, 61, 28], [7]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def make_block(target, head="none", confidence=False, block_size=4, seed=0, std=0.2) -> BlockDraftModel:
    torch.manual_seed(seed)
    model = BlockDraftModel(target.config, BlockConfig(target_layers=(1,), block_size=block_size, num_layers=1,
                                                      head=head, markov_rank=8, confidence=confidence))
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            torch.nn.init.normal_(p, std=std)
    return model.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_model(0, 0.2)


@pytest.fixture(scope="module")
def plain(target):
    return [decode(target, p, GREEDY).token_ids for p in PROMPTS]


KINDS = {"parallel": dict(head="none"), "dspark": dict(head="markov", confidence=True),
         "dspark-rnn": dict(head="rnn", confidence=True), "parallel+confidence": dict(head="none", confidence=True)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("k", [1, 3, 4])
def test_greedy_equals_plain(kind, k, target, plain):
    """A1: random block drafters, any k (capped at the block size): output equals plain greedy decoding."""
    for prompt, ref in zip(PROMPTS, plain):
        drafter = BlockDrafter(make_block(target, **KINDS[kind]), target)
        out = decode(target, prompt, GREEDY, drafter=drafter, spec=SpecConfig(k=k))
        assert out.token_ids == ref
        assert out.stats.num_drafts > 0


@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_greedy_with_block_drafters(kind, target, plain):
    """The engine feeds the drafter's context from prefill chunks and every verified round, mixed in a batch."""
    drafters = {"b": BlockDrafter(make_block(target, **KINDS[kind]), target)}
    engine = Engine(target, None, EngineConfig(k=4, drafter="b", prefill_chunk=6), drafters=drafters)
    ids = [engine.add_request(p, GREEDY, RequestSpec(k=k)) for p, k in zip(PROMPTS, (4, 2, 3))]
    ids.append(engine.add_request(PROMPTS[0], GREEDY, RequestSpec(drafter="ngram")))
    results = engine.run_until_done()
    for i, ref in enumerate(plain + plain[:1]):
        assert results[ids[i]].token_ids == ref


def test_context_cache_equals_recomputation(target):
    """After several rounds the drafter's incremental context (prefill + accepted rows) gives the same block as
    context features recomputed from one target forward over all committed tokens."""
    model = make_block(target, head="markov", confidence=True)
    drafter = BlockDrafter(model, target)
    out = decode(target, PROMPTS[1], SamplingParams(max_tokens=10, ignore_eos=True), drafter=drafter,
                 spec=SpecConfig(k=3), seq_id=5)
    tokens = PROMPTS[1] + out.token_ids
    drafter.start(9, tokens)
    with torch.inference_mode():
        _, hidden = target(torch.tensor([tokens[:-1]]), hidden_layers=(1,))
        drafter.observe(9, 0, {1: hidden[1][0]})
        req = DraftRequest(9, tokens, 4, SamplingParams(), None)
        fresh = drafter.propose([req])[0]
    # The same drafter replayed round by round (seq 5 was finished by decode): rebuild it incrementally.
    incremental = BlockDrafter(model, target)
    decode(target, PROMPTS[1], SamplingParams(max_tokens=10, ignore_eos=True), drafter=_Recorder(incremental, tokens),
           spec=SpecConfig(k=3), seq_id=7)
    assert incremental.last == fresh.tokens


def test_rnn_head_follows_dspark_recurrence(target):
    """head_bias for the RNN head is DSpark's cell written out: z_k = [s_{k-1}; W1[x_{k-1}]; h_k], one linear map to
    gate / candidate / output, s_k = sig(g) s_{k-1} + (1 - sig(g)) tanh(c), B_k = W2 tanh(o), s_0 = 0; so unlike
    the Markov head, B_k depends on tokens before x_{k-1}."""
    model = make_block(target, head="rnn", confidence=True)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(1, 3, target.config.hidden_size, generator=gen).expand(2, -1, -1)  # the same block states
    prev = torch.tensor([[5, 9, 11], [6, 9, 11]])  # and the same x_1, x_2, after different anchors
    with torch.no_grad():
        got = model.head_bias(h, prev)
        w1, cell, w2 = model.markov_in.weight, model.rnn_cell, model.markov_out.weight
        r = model.config.markov_rank
        for n in range(2):
            s = torch.zeros(r)
            for k in range(3):
                g, c, o = (cell.weight @ torch.cat([s, w1[prev[n, k]], h[n, k]]) + cell.bias).split(r)
                torch.testing.assert_close(got[n, k], w2 @ torch.tanh(o), rtol=1e-5, atol=1e-5)
                s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(c)
    assert not torch.allclose(got[0, 2], got[1, 2])  # the anchor still matters two positions later
    assert got.shape == (2, 3, target.config.vocab_size)


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_forward_drafts_what_inference_drafts(kind, target):
    """The trainer's block forward (teacher-forced Markov bias) and the drafter's propose are one computation:
    with the proposal itself as the labels, the training logits' argmax is the proposal at every position, and
    the confidences agree. Guards the offsets between the two paths (anchor position, RoPE, context mask)."""
    from verispec.train.block import BlockBatch, block_forward

    model = make_block(target, **KINDS[kind])
    drafter = BlockDrafter(model, target)
    prompt = PROMPTS[0]
    with torch.inference_mode():
        _, hidden = target(torch.tensor([prompt]), hidden_layers=(1,))
        drafter.start(0, prompt)
        drafter.observe(0, 0, {1: hidden[1][0, :-1]})
        draft = drafter.propose([DraftRequest(0, prompt, 4, SamplingParams(), None)])[0]
        g = model.config.block_size
        blocks = BlockBatch(anchors=torch.tensor([prompt[-1]]), anchor_pos=torch.tensor([len(prompt) - 1]),
                            labels=torch.tensor([draft.tokens]), mask=torch.ones(1, g, dtype=torch.bool),
                            seq=torch.tensor([0]))
        logits, confidence, _ = block_forward(model, target, torch.tensor([prompt]), blocks, hidden)
    assert logits[0].argmax(-1).tolist() == draft.tokens
    if confidence is not None:
        torch.testing.assert_close(confidence[0], draft.confidence, rtol=1e-5, atol=1e-6)


class _Recorder(BlockDrafter):
    """Wraps a drafter; at the end, proposes from its incrementally built context for the final tokens."""

    def __init__(self, inner: BlockDrafter, final_tokens: list[int]) -> None:
        self.inner, self.final = inner, final_tokens
        self.capabilities = inner.capabilities

    def start(self, seq_id, prompt):
        self.inner.start(seq_id, prompt)

    def observe(self, seq_id, start, hidden):
        self.inner.observe(seq_id, start, hidden)

    def propose(self, requests):
        return self.inner.propose(requests)

    def accept(self, result):
        self.inner.accept(result)

    def finish(self, seq_id):
        with torch.inference_mode():
            req = DraftRequest(seq_id, self.final, 4, SamplingParams(), None)
            self.inner.last = self.inner.propose([req])[0].tokens
        self.inner.finish(seq_id)


def test_confidence_is_a_probability_per_position(target):
    drafter = BlockDrafter(make_block(target, head="markov", confidence=True), target, temperatures=[2.0, 0.5])
    drafter.start(0, PROMPTS[0])
    with torch.inference_mode():
        _, hidden = target(torch.tensor([PROMPTS[0][:-1]]), hidden_layers=(1,))
    drafter.observe(0, 0, {1: hidden[1][0]})
    draft = drafter.propose([DraftRequest(0, PROMPTS[0], 3, SamplingParams(), None)])[0]
    assert len(draft.tokens) == 3 and draft.confidence.shape == (3,)
    assert ((draft.confidence > 0) & (draft.confidence < 1)).all()


def test_checkpoint_round_trip_and_errors(tmp_path, target):
    model = make_block(target, head="markov", confidence=True)
    save_block_drafter(model, tmp_path / "d")
    (tmp_path / "d" / "calibration.json").write_text(json.dumps({"sts_temperatures": [1.5, 1.0]}))
    loaded = load_block_drafter(tmp_path / "d", target)
    assert loaded.temperatures == [1.5, 1.0]
    for (name, a), b in zip(model.state_dict().items(), loaded.model.state_dict().values()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=name)
    assert isinstance(build_drafter(f"dspark:{tmp_path / 'd'}", target=target, dtype=torch.float32,
                                    device=torch.device("cpu")), BlockDrafter)
    save_block_drafter(make_block(target), tmp_path / "p")
    with pytest.raises(CheckpointError, match="parallel block drafter"):
        build_drafter(f"dspark:{tmp_path / 'p'}", target=target, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_block_drafter(tmp_path / "d", tiny_model(0, 0.2, hidden_size=32, head_dim=8))
    (tmp_path / "d" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception):  # safetensors' own error, never a pickle fallback
        load_block_drafter(tmp_path / "d", target)
    with pytest.raises(CheckpointError, match="not a block drafter"):
        load_block_drafter(tmp_path / "missing", target)
    with pytest.raises(ConfigError, match="head"):
        BlockConfig(target_layers=(1,), head="gru")


N_STAT = 2000


@pytest.fixture(scope="module")
def stat_target():
    return tiny_model(0, 0.25, vocab_size=SV, max_position_embeddings=16, num_hidden_layers=2)


@pytest.mark.parametrize("kind", list(KINDS))
def test_block_drafter_samples_from_target(kind, stat_target):
    """A5 through the engine with a random block drafter (q from the head, sampled left to right)."""
    drafter = BlockDrafter(make_block(stat_target, block_size=2, std=0.5, **KINDS[kind]), stat_target)
    _assert_engine_samples_from_target(drafter, stat_target)


def _assert_engine_samples_from_target(drafter: BlockDrafter, stat_target, max_running: int = 250) -> None:
    """N_STAT seeded requests through the engine: consecutive output pairs follow the target's exact joints."""
    joints = exact_pair_joints(stat_target, S_PROMPT, S_PARAMS)
    engine = Engine(stat_target, None, EngineConfig(k=2, drafter="b", max_running=max_running, max_queued=N_STAT),
                    drafters={"b": drafter})
    for i in range(N_STAT):
        engine.add_request(S_PROMPT, SamplingParams(max_tokens=3, temperature=1.0, seed=i), request_id=str(i))
    results = engine.run_until_done()
    assert 0 < engine.metrics.num_accepted_tokens < engine.metrics.num_draft_tokens
    samples = np.array([results[str(i)].token_ids for i in range(N_STAT)])
    for cols, joint in (([0, 1], joints[0]), ([1, 2], joints[1])):
        tv, pval, impossible = check_pair(samples[:, cols], joint)
        assert tv < tv_limit(SV * SV, N_STAT) and pval > ALPHA and impossible == 0, (tv, pval)


def test_batched_proposals_equal_one_at_a_time(target):
    """Contexts of different lengths padded and masked in one block forward: each request's draft (tokens and
    confidences) equals its draft proposed alone."""
    drafter = BlockDrafter(make_block(target, head="markov", confidence=True), target)
    reqs = []
    for i, p in enumerate(PROMPTS):
        drafter.start(i, p)
        if len(p) > 1:
            with torch.inference_mode():
                _, hidden = target(torch.tensor([p[:-1]]), hidden_layers=(1,))
            drafter.observe(i, 0, {1: hidden[1][0]})
        reqs.append(DraftRequest(i, p, 4 - i, SamplingParams(), None))
    together = drafter.propose(reqs)
    for r, d in zip(reqs, together):
        alone = drafter.propose([r])[0]
        assert d.tokens == alone.tokens and len(d.tokens) == r.budget
        torch.testing.assert_close(d.confidence, alone.confidence, rtol=1e-5, atol=1e-6)


def test_pending_rows_of_a_batch_are_projected_together_into_each_context(target):
    """A batched proposal projects every sequence's pending rows in one pass per layer (rows of several rounds, a
    windowed restart past a gap): each context cache equals the one its rows give on their own."""
    model = make_block(target, head="markov", confidence=True)
    together, alone = BlockDrafter(model, target, context_window=4), BlockDrafter(model, target, context_window=4)
    with torch.inference_mode():
        hidden = [target(torch.tensor([p]), hidden_layers=(1,))[1][1][0] for p in PROMPTS[:2]]
    for d in (together, alone):
        for i, p in enumerate(PROMPTS[:2]):
            d.start(i, p)
            d.observe(i, 0, {1: hidden[i][:3]})
            d.observe(i, 3, {1: hidden[i][3:5]})  # a second chunk waits beside the first
        d.observe(1, 6, {1: hidden[1][6:7]})  # a gap past position 5: sequence 1's context restarts at 6
    together._flush(0, 1)
    alone._flush(0)
    alone._flush(1)
    for i, n in ((0, 5), (1, 1)):
        a, b = together._context(i), alone._context(i)
        assert a.length == b.length == n and together._ctx_start[i] == alone._ctx_start[i]
        torch.testing.assert_close(a.k[:, :, :, :n], b.k[:, :, :, :n], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.v[:, :, :, :n], b.v[:, :, :, :n], rtol=1e-5, atol=1e-6)


def test_torch_head_loop_drafts_what_the_native_loop_drafts(target, monkeypatch):
    """Greedy DSpark drafts come from kernels/markov.c where it runs, from the torch head loop elsewhere: the
    same tokens and confidences either way. The transition bias is scaled up so that it decides tokens."""
    model = make_block(target, head="markov", confidence=True)
    with torch.no_grad():
        model.markov_out.weight.mul_(30.0)
    drafter = BlockDrafter(model, target)
    reqs = []
    for i, p in enumerate(PROMPTS[:2]):
        drafter.start(i, p)
        with torch.inference_mode():
            _, hidden = target(torch.tensor([p[:-1]]), hidden_layers=(1,))
        drafter.observe(i, 0, {1: hidden[1][0]})
        reqs.append(DraftRequest(i, p, 4, SamplingParams(), None))
    drafts = [drafter.propose([r])[0] for r in reqs] + drafter.propose(reqs)
    monkeypatch.setattr(drafter, "_native_markov", lambda: None)
    looped = [drafter.propose([r])[0] for r in reqs] + drafter.propose(reqs)
    for a, b in zip(drafts, looped):
        assert a.tokens == b.tokens and len(a.tokens) == 4
        torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)


def test_lm_head_runs_only_on_drafted_positions(target):
    """A round's cost: the shared LM head sees the positions some request drafts, not the whole block."""
    drafter = BlockDrafter(make_block(target, head="markov", confidence=True, block_size=8), target)
    rows = []
    hook = target.lm_head.register_forward_hook(lambda m, inp, out: rows.append(inp[0].shape[:-1]))
    try:
        for i, budget in enumerate((1, 3)):
            drafter.start(i, [7])
            draft = drafter.propose([DraftRequest(i, [7], budget, SamplingParams(), None)])[0]
            assert len(draft.tokens) == budget and len(draft.confidence) == budget
    finally:
        hook.remove()
    assert rows == [torch.Size([1, 1]), torch.Size([1, 3])]


def test_drafter_runs_in_the_targets_dtype(tmp_path, target):
    """A bf16 target on CPU gets an fp32 drafter (its layers and head loop then run natively), with fp32 RoPE tables
    and fp32 context attention; its drafts match the fp32 drafter's on this tiny model and decoding stays
    lossless."""
    save_block_drafter(make_block(target, head="markov", confidence=True), tmp_path / "d")
    save_model(target, tmp_path / "t")
    bf16 = load_model(tmp_path / "t", dtype="bf16")
    drafter = load_block_drafter(tmp_path / "d", bf16)
    assert {p.dtype for p in drafter.model.parameters()} == {torch.float32}
    assert drafter.model.rotary_emb.cos.dtype == torch.float32
    ref = decode(bf16, PROMPTS[0], GREEDY).token_ids
    out = decode(bf16, PROMPTS[0], GREEDY, drafter=drafter, spec=SpecConfig(k=1))
    assert out.token_ids == ref and out.stats.num_drafts > 0
    fp32 = load_block_drafter(tmp_path / "d", target)
    req = [DraftRequest(0, [7], 4, SamplingParams(), None)]
    drafter.start(0, [7]), fp32.start(0, [7])
    assert drafter._context(0).k.dtype == torch.float32
    assert drafter.propose(req)[0].tokens == fp32.propose(req)[0].tokens


# ---- the deferred context append --------------------------------------------------------------------------------

def _observed(drafter, seq_id, prompt, target):
    drafter.start(seq_id, prompt)
    with torch.inference_mode():
        _, hidden = target(torch.tensor([prompt]), hidden_layers=(1,))
    drafter.observe(seq_id, 0, {1: hidden[1][0, : len(prompt) - 1]})
    drafter._flush(seq_id)  # observed rows wait for the next proposal; the tests look at the projected cache
    return hidden[1][0]


@pytest.mark.parametrize("rounds", [1, 2])
def test_accepted_rows_projected_with_the_block_equal_a_separate_append(rounds, target):
    """accept() (and observe()) defer rows to the next proposal, which projects them together with the block (and
    after prompt-lookup rounds, several rounds' rows at once): the same context cache and the same draft as
    appending them on their own first."""
    model = make_block(target, head="markov", confidence=True)
    fused, separate = BlockDrafter(model, target), BlockDrafter(model, target)
    tokens = PROMPTS[0]
    head = 6  # the prompt the drafters start from; later tokens arrive as accepted rows
    for d in (fused, separate):
        hidden = _observed(d, 0, tokens[:head], target)
    with torch.inference_mode():
        _, hidden = target(torch.tensor([tokens]), hidden_layers=(1,))
    pos = head - 1
    for n in [3, 2][:rounds]:  # rows of the anchor and n - 1 accepted drafts
        rows = {1: hidden[1][0, pos : pos + n]}
        fused.accept(Verified(0, n - 1, [], rows))
        separate.observe(0, pos, rows)
        separate._flush(0)  # appended on their own, before the proposal
        pos += n
    assert fused.context_length(0) == separate._context(0).length == pos
    req = [DraftRequest(0, tokens[: pos + 1], 4, SamplingParams(), None)]
    a, b = fused.propose(req)[0], separate.propose(req)[0]
    assert a.tokens == b.tokens and len(a.tokens) == 4
    torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)
    for c in (fused._context(0), separate._context(0)):
        assert c.length == pos
    for name in ("k", "v"):
        torch.testing.assert_close(getattr(fused._context(0), name)[:, :, :, :pos],
                                   getattr(separate._context(0), name)[:, :, :, :pos], rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="anchor is at"):  # the context and the anchor disagree: said, not drafted
        fused.propose([DraftRequest(0, tokens[: pos + 2], 4, SamplingParams(), None)])
    fused.accept(Verified(0, 0, [], {1: hidden[1][0, pos : pos + 1]}))
    fused.start(0, tokens[:head])  # a restart forgets rows still waiting from the previous run
    assert fused.context_length(0) == 0


# ---- the draft vocabulary (FR-Spec) -----------------------------------------------------------------------------

def _draft_vocab(vocab_size: int, size: int, seed: int = 0) -> torch.Tensor:
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size].sort().values


@pytest.mark.parametrize("kind", list(KINDS))
def test_draft_vocabulary_greedy_equals_plain(kind, target, plain):
    """Drafts only from the draft vocabulary, and the output is still exactly plain decoding's."""
    ids = _draft_vocab(target.config.vocab_size, 40)
    drafter = BlockDrafter(make_block(target, **KINDS[kind]), target, draft_vocab=ids)
    seen = set()
    inner = drafter.propose

    def propose(requests):
        drafts = inner(requests)
        seen.update(t for d in drafts for t in d.tokens)
        return drafts

    drafter.propose = propose
    for prompt, ref in zip(PROMPTS, plain):
        out = decode(target, prompt, GREEDY, drafter=drafter, spec=SpecConfig(k=3))
        assert out.token_ids == ref
    assert seen and seen <= set(ids.tolist())


@pytest.mark.parametrize("native_loop", [True, False])
def test_draft_vocabulary_drafts_the_best_token_inside_it(native_loop, target, monkeypatch):
    """With a draft vocabulary the greedy Markov loop (native or torch) drafts argmax over the set's columns of
    the full-vocabulary logits U_j + W2 W1[x_{j-1}]: cutting the LM head and W2 to the set changes nothing else."""
    model = make_block(target, head="markov", confidence=True)
    with torch.no_grad():
        model.markov_out.weight.mul_(30.0)  # the transition bias decides tokens
    ids = _draft_vocab(target.config.vocab_size, 30, seed=1)
    full, cut = BlockDrafter(model, target), BlockDrafter(model, target, draft_vocab=ids)
    if not native_loop:
        monkeypatch.setattr(cut, "_native_markov", lambda: None)
    prompt = PROMPTS[1]
    for d in (full, cut):
        _observed(d, 0, prompt, target)
    req = [DraftRequest(0, prompt, 4, SamplingParams(), None)]
    with torch.inference_mode():
        embed = target.model.embed_tokens
        h = model.block_hidden(embed, torch.tensor([prompt[-1]]), torch.tensor([len(prompt) - 1]), full._context(0))
        base = full._block_logits(h[:, :4])[0]  # [4, V]
        want, prev = [], prompt[-1]
        for j in range(4):
            logits = base[j] + model.markov_bias(torch.tensor(prev)).float()
            prev = int(ids[logits[ids].argmax()])
            want.append(prev)
        got = cut.propose(req)[0]
        conf = torch.sigmoid(model.confidence_logit(h[0, :4], torch.tensor([prompt[-1], *want[:-1]])))
    assert got.tokens == want
    torch.testing.assert_close(got.confidence, conf, rtol=1e-5, atol=1e-6)  # c_j from h_j and the drafted x_{j-1}


@pytest.mark.parametrize("kind", ["parallel", "dspark"])
def test_draft_vocabulary_samples_from_target(kind, stat_target):
    """Sampled drafts from a 5-of-8-token draft vocabulary: q is zero outside it and sums to one, and the engine's
    output pairs still follow the target's exact joint distribution."""
    ids = torch.tensor([0, 2, 3, 5, 6])
    drafter = BlockDrafter(make_block(stat_target, block_size=2, std=0.5, **KINDS[kind]), stat_target, draft_vocab=ids)
    drafter.start(99, S_PROMPT)
    with torch.inference_mode():
        _, hidden = stat_target(torch.tensor([S_PROMPT[:-1]]), hidden_layers=(1,))
    drafter.observe(99, 0, {1: hidden[1][0]})
    gen = torch.Generator().manual_seed(0)
    draft = drafter.propose([DraftRequest(99, S_PROMPT, 2, S_PARAMS, gen)])[0]
    outside = torch.ones(SV, dtype=torch.bool)
    outside[ids] = False
    assert set(draft.tokens) <= set(ids.tolist()) and (draft.probs[:, outside] == 0).all()
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(2))
    drafter.finish(99)
    _assert_engine_samples_from_target(drafter, stat_target)


def test_draft_vocabulary_files_load_or_fail_clearly(tmp_path, target):
    from verispec.train.draft_vocab import top_tokens

    d = tmp_path / "d"
    save_block_drafter(make_block(target, head="markov", confidence=True), d)
    assert load_block_drafter(d, target).draft_vocab is None
    (d / "draft_vocab.json").write_text(json.dumps({"token_ids": [9, 3, 40]}))
    with pytest.raises(CheckpointError, match="ascending"):
        load_block_drafter(d, target)
    (d / "draft_vocab.json").write_text(json.dumps({"token_ids": [3, 9, target.config.vocab_size]}))
    with pytest.raises(CheckpointError, match="must lie in"):
        load_block_drafter(d, target)
    (d / "draft_vocab.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="draft_vocab.json is not a draft vocabulary"):
        load_block_drafter(d, target)
    counts = np.zeros(target.config.vocab_size, dtype=np.int64)
    counts[[50, 7, 60]] = [5, 9, 5]
    ids = top_tokens(counts, 3, always=[1])  # the end token, then by count, ties to the lower id
    assert ids == [1, 7, 50]
    (d / "draft_vocab.json").write_text(json.dumps({"token_ids": ids}))
    drafter = load_block_drafter(d, target)
    assert drafter.draft_vocab.tolist() == ids
    assert load_block_drafter(d, target, draft_vocab=False).draft_vocab is None
    with pytest.raises(ValueError, match="size"):
        top_tokens(counts, 0)


def test_full_vocab_spec_ignores_the_draft_vocabulary(tmp_path, target):
    d = tmp_path / "d"
    save_block_drafter(make_block(target, head="markov", confidence=True), d)
    (d / "draft_vocab.json").write_text(json.dumps({"token_ids": [1, 7, 50]}))
    kw = dict(target=target, dtype=torch.float32, device=torch.device("cpu"))
    assert build_drafter(f"dspark:{d}", **kw).draft_vocab.tolist() == [1, 7, 50]
    assert build_drafter(f"dspark:{d}:full-vocab", **kw).draft_vocab is None
    assert build_drafter(f"lookup:block:{d}:full-vocab", **kw).inner.draft_vocab is None


# ---- the native block layer (kernels/blocklayer.c) ---------------------------------------------------------------

@pytest.fixture
def native_calls(monkeypatch):
    """Counts calls of the native block layer (and fails a test that expects it where the kernels are missing)."""
    if not native.available():
        pytest.skip(no_native_reason())
    calls = []
    inner = native.block_layer

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return inner(*args, **kw)

    monkeypatch.setattr(native, "block_layer", counted)
    return calls


def quantize_layers(model: BlockDraftModel, bits: int) -> BlockDraftModel:
    """Its decoder layers' projections as int QuantLinears (RTN, groups of 32 for int4, per channel for int8), as
    a quantized drafter checkpoint loads (quant.drafter)."""
    for name in [f"layers.{i}.{p}" for i in range(len(model.layers)) for p in PROJECTIONS]:
        parent, _, child = name.rpartition(".")
        w = model.get_submodule(name).weight.detach()
        q, scales = quantize_rtn(w, QuantScheme(bits, 32 if bits == 4 else None), torch.float32)
        setattr(model.get_submodule(parent), child, QuantLinear(q, scales, bits))
    return model


def native_model(target, bits: int, **kw) -> BlockDraftModel:
    """A markov, confidence-headed drafter with int `bits` layers (0: dense), loaded for inference; skips where
    the int kernels cannot build."""
    model = make_block(target, head="markov", confidence=True, seed=3, **kw)
    if bits:
        if not native.qavailable():
            pytest.skip(no_native_reason())
        quantize_layers(model, bits)
    return model.prepare_inference()


@pytest.mark.parametrize("bits", [0, 4, 8])
@pytest.mark.parametrize("pending", [0, 3])
def test_native_block_layers_equal_the_torch_layers(pending, bits, target, native_calls):
    """A loaded drafter (fused, packed; dense, or with int4/int8 layers) proposes for one sequence through
    kernels/blocklayer.c: the same drafts, confidences, block states and context cache (the rows it commits and
    the block's uncommitted ones) as the torch layers, to rounding, with and without accepted rows riding on the
    proposal."""
    model = native_model(target, bits, block_size=4)
    prompt = PROMPTS[0]
    head = len(prompt) - pending
    with torch.inference_mode():
        _, hidden = target(torch.tensor([prompt]), hidden_layers=(1,))
    out = {}
    for use_native in (True, False):
        model.use_native = use_native
        drafter = BlockDrafter(model, target)
        _observed(drafter, 0, prompt[:head], target)
        if pending:
            drafter.accept(Verified(0, pending - 1, [], {1: hidden[1][0, head - 1 : head - 1 + pending]}))
        draft = drafter.propose([DraftRequest(0, prompt, 4, SamplingParams(), None)])[0]
        cache = drafter._context(0)
        with torch.inference_mode():  # the block again over the committed context: its states and cache rows
            h = model.block_hidden(target.model.embed_tokens, torch.tensor([prompt[-1]]),
                                   torch.tensor([len(prompt) - 1]), cache)
        end = cache.length + model.config.block_size
        out[use_native] = (draft, h, cache.k[:, :, :, :end].clone(), cache.v[:, :, :, :end].clone(), cache.length)
    model.use_native = True
    assert len(native_calls) == 2 * model.config.num_layers  # the proposal and the check above, every layer
    (a, ha, ka, va, la), (b, hb, kb, vb, lb) = out[True], out[False]
    assert a.tokens == b.tokens and len(a.tokens) == 4 and la == lb == len(prompt) - 1
    torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)
    for x, y in ((ha, hb), (ka, kb), (va, vb)):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_native_block_layers_take_batches_in_one_call_and_stay_out_of_training(target, native_calls,
                                                                                monkeypatch):
    """A batched proposal runs each layer once for all its sequences (native.block_layers, no padding or mask); a
    single one takes native.block_layer; anything that wants a gradient keeps the torch layers."""
    model = make_block(target, head="markov", confidence=True).prepare_inference()
    drafter = BlockDrafter(model, target)
    batches = []
    inner = native.block_layers
    monkeypatch.setattr(native, "block_layers", lambda *a, **kw: (batches.append(len(a[2])), inner(*a, **kw))[1])
    reqs = []
    for i, p in enumerate(PROMPTS[:2]):
        _observed(drafter, i, p, target)
        reqs.append(DraftRequest(i, p, 4, SamplingParams(), None))
    drafter.propose(reqs)
    assert native_calls == [] and batches == [2] * model.config.num_layers
    with torch.inference_mode():
        drafter.propose(reqs[:1])
    assert len(native_calls) == model.config.num_layers
    ctx = drafter._context(0)
    x = torch.zeros(1, 4, target.config.hidden_size, requires_grad=True)
    assert model._native_args(x, ctx, None) is None  # a gradient is wanted
    with torch.no_grad():
        assert model._native_args(x.detach(), ctx, None) is not None
        assert model._native_args(x.detach().bfloat16(), ctx, None) is None
    with torch.enable_grad():
        assert not model.native_batch([ctx])


@pytest.mark.parametrize("bits", [0, 4])
def test_native_layer_arguments_are_described_once_and_remade_when_a_weight_changes(bits, target, native_calls):
    """A layer's kernel arguments (native.BlockLayerArgs: norms, packs, descriptors) are made once and reused while
    its weights and norms stay as they are; a norm changed in place or replaced, or a weight replaced, makes them
    anew, and the native block states follow the change as the torch layers do."""
    model = native_model(target, bits, block_size=4)
    drafter = BlockDrafter(model, target)
    _observed(drafter, 0, PROMPTS[0], target)
    cache = drafter._context(0)
    layer = model.layers[0]
    x = torch.zeros(1, target.config.hidden_size)

    def states(use_native: bool) -> torch.Tensor:
        model.use_native = use_native
        with torch.inference_mode():
            h = model.block_hidden(target.model.embed_tokens, torch.tensor([PROMPTS[0][-1]]),
                                   torch.tensor([len(PROMPTS[0]) - 1]), cache)
        model.use_native = True
        return h

    with torch.no_grad():
        first = layer.native_args(x)
        assert first is not None and layer.native_args(x) is first
        layer.post_attention_layernorm.weight.mul_(1.5)  # in place: a new version of the same storage
        second = layer.native_args(x)
        assert second is not first and layer.native_args(x) is second
        layer.input_layernorm.weight = torch.nn.Parameter(layer.input_layernorm.weight * 0.5)  # a new tensor
        third = layer.native_args(x)
        assert third is not second and third.norm_ptrs[0] == layer.input_layernorm.weight.data_ptr()
        if not bits:  # a replaced weight (a fused one remade) is packed anew
            layer.fuse()
        else:  # int scales changed in place: the int pack is remade (QuantLinear.qpacked), and the arguments
            layer.o_proj.scales.mul_(1.5)
        assert layer.native_args(x) is not third
    calls = len(native_calls)
    torch.testing.assert_close(states(True), states(False), rtol=1e-5, atol=1e-5)
    assert len(native_calls) == calls + model.config.num_layers  # the native side took the kernel


@pytest.mark.parametrize("bits", [0, 4])
@pytest.mark.parametrize("pending", [False, True])
def test_native_batched_proposals_equal_one_at_a_time(pending, bits, target, native_calls):
    """Sequences of different context lengths (pending rows riding on the proposal or not) drafted together by the
    native batched layers (dense or int4): each draft and context cache equals the one its sequence gets alone."""
    model = native_model(target, bits)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:9]]
    out = {}
    for batched in (True, False):
        drafter = BlockDrafter(model, target)
        reqs = []
        for i, p in enumerate(prompts):
            head = len(p) - (3 if pending else 0)
            hidden = _observed(drafter, i, p[:head], target)
            if pending:
                with torch.inference_mode():
                    _, full = target(torch.tensor([p]), hidden_layers=(1,))
                drafter.accept(Verified(i, 2, [], {1: full[1][0, head - 1 : head + 2]}))
            reqs.append(DraftRequest(i, p, 4, SamplingParams(), None))
        drafts = drafter.propose(reqs) if batched else [drafter.propose([r])[0] for r in reqs]
        caches = [drafter._context(i) for i in range(len(prompts))]
        out[batched] = (drafts, [(c.length, c.k[:, :, :, : c.length].clone(), c.v[:, :, :, : c.length].clone())
                                 for c in caches])
    for a, b in zip(out[True][0], out[False][0]):
        assert a.tokens == b.tokens and len(a.tokens) == 4
        torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)
    for (la, ka, va), (lb, kb, vb) in zip(out[True][1], out[False][1]):
        assert la == lb
        torch.testing.assert_close(ka, kb, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(va, vb, rtol=1e-5, atol=1e-6)


def test_block_drafter_norms_are_native_at_inference_only(target, native_calls, monkeypatch):
    """The context and final norms of a proposal take native.rmsnorm; training (a gradient) and use_native=False
    keep the torch module, and both give the same states to rounding."""
    model = make_block(target, head="markov", confidence=True).prepare_inference()
    norms = []
    inner = native.rmsnorm
    monkeypatch.setattr(native, "rmsnorm", lambda *a: norms.append(a[0].shape) or inner(*a))
    hidden = {1: torch.randn(5, target.config.hidden_size)}
    with torch.inference_mode():
        fast = model.context_features(hidden)
        model.use_native = False
        slow = model.context_features(hidden)
        model.use_native = True
    assert len(norms) == 1
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    model.context_features(hidden)  # grad mode: torch
    assert len(norms) == 1
    drafter = BlockDrafter(model, target)
    _observed(drafter, 0, PROMPTS[0], target)
    drafter.propose([DraftRequest(0, PROMPTS[0], 4, SamplingParams(), None)])
    # the prompt's context rows (observe) and the block's final norm
    d = target.config.hidden_size
    assert norms[1:] == [torch.Size([len(PROMPTS[0]) - 1, d]), torch.Size([1, 4, d])] and native_calls


@pytest.mark.parametrize("kind", ["parallel", "dspark"])
def test_native_block_drafter_greedy_equals_plain(kind, target, plain, native_calls):
    """A1 with loaded (fused, native) block drafters through decode and the engine."""
    model = make_block(target, **KINDS[kind]).prepare_inference()
    for prompt, ref in zip(PROMPTS, plain):
        out = decode(target, prompt, GREEDY, drafter=BlockDrafter(model, target), spec=SpecConfig(k=4))
        assert out.token_ids == ref and out.stats.num_drafts > 0
    engine = Engine(target, None, EngineConfig(k=4, drafter="b", max_running=1),
                    drafters={"b": BlockDrafter(model, target)})
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    results = engine.run_until_done()
    assert [results[i].token_ids for i in ids] == plain
    assert native_calls


def test_native_block_drafter_samples_from_target(stat_target, native_calls):
    """A5 through the engine one request at a time, so that every proposal takes the native layers."""
    model = make_block(stat_target, block_size=2, std=0.5, **KINDS["dspark"]).prepare_inference()
    _assert_engine_samples_from_target(BlockDrafter(model, stat_target), stat_target, max_running=1)
    assert native_calls
