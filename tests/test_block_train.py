"""Block-drafter training at toy scale: every loss runs, training on the target's own continuations makes the
drafter agree with it (tau rises), resuming continues exactly, and the result drafts losslessly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_continuations, tiny_model

from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import build_drafter
from verispec.drafters.block import (
    BlockDrafter, load_block_drafter, read_block_drafter, save_block_drafter,
)
from verispec.train.block import BlockTrainConfig, sample_blocks, train_block_drafter
from verispec.train.losses import LOSSES


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target and 24 of its own greedy continuations (prompt 8 + 24 tokens)."""
    return tiny_continuations(tmp_path_factory.mktemp("blk"))


def cfg(**kw) -> BlockTrainConfig:
    base = dict(kind="dspark", loss="dspark", block_size=4, num_layers=1, target_layers=(1,), markov_rank=8,
                batch_size=4, anchors=4, prompt_len=8, lr=3e-3, warmup_steps=2, max_steps=6)
    base.update(kw)
    return BlockTrainConfig(**base)


def test_anchors_and_labels():
    tokens = torch.arange(40).view(2, 20)
    b = sample_blocks(tokens, cfg(), step=0)
    assert ((b.anchor_pos >= 7) & (b.anchor_pos <= 18)).all()
    for i in range(len(b.anchors)):
        row, pos = int(b.seq[i]), int(b.anchor_pos[i])
        assert b.anchors[i] == tokens[row, pos]
        want = tokens[row, pos + 1 : pos + 5]
        assert torch.equal(b.labels[i, : len(want)], want) and b.mask[i].sum() == len(want)


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_trains(loss, setup, tmp_path):
    path, _, seqs = setup
    kind = "dspark" if loss == "dspark" else "block"
    model = train_block_drafter(path / "target", seqs, tmp_path / loss, cfg(kind=kind, loss=loss), 3, progress=False)
    import json

    log = json.loads((tmp_path / loss / "state" / "meta.json").read_text())["log"]
    assert len(log) == 6 and all(np.isfinite(e["loss"]) for e in log)
    assert model.config.head == ("markov" if kind == "dspark" else "none")


def test_the_rnn_head_trains_ships_and_drafts_losslessly(setup, tmp_path):
    """--head rnn: the recurrent cell and W2 learn (they start from zero bias), the checkpoint loads as a dspark
    drafter with its head, and its drafts leave greedy decoding unchanged."""
    path, target, seqs = setup
    model = train_block_drafter(path / "target", seqs, tmp_path / "rnn", cfg(head="rnn", max_steps=8), 3,
                                progress=False)
    assert model.config.head == "rnn"
    assert model.markov_out.weight.abs().sum() > 0  # W2 is zero at init: it moved
    save_block_drafter(model, tmp_path / "d")
    drafter = build_drafter(f"dspark:{tmp_path / 'd'}", target=target, dtype=torch.float32,
                            device=torch.device("cpu"))
    assert drafter.model.config.head == "rnn"
    for prompt in (seqs[0][:8].tolist(), seqs[5][:8].tolist()):
        plain = decode(target, prompt, SamplingParams(max_tokens=20, ignore_eos=True))
        spec = decode(target, prompt, SamplingParams(max_tokens=20, ignore_eos=True), drafter=drafter,
                      spec=SpecConfig(k=4))
        assert spec.token_ids == plain.token_ids and spec.stats.num_drafts > 0
    with pytest.raises(ValueError, match="head"):
        cfg(head="gru")


def test_training_raises_tau_and_drafts_losslessly(setup, tmp_path):
    path, target, seqs = setup
    c = cfg(kind="block", loss="ce", max_steps=80, lr=1e-2, warmup_steps=5)
    model = train_block_drafter(path / "target", seqs, tmp_path / "r", c, 3, progress=False)
    import json

    log = json.loads((tmp_path / "r" / "state" / "meta.json").read_text())["log"]
    early = np.mean([e["tau"] for e in log[:5]])
    late = np.mean([e["tau"] for e in log[-10:]])
    assert late > early + 0.5, (early, late)
    save_block_drafter(model, tmp_path / "d")
    drafter = load_block_drafter(tmp_path / "d", target)
    prompt = seqs[0][:8].tolist()
    plain = decode(target, prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    spec = decode(target, prompt, SamplingParams(max_tokens=20, ignore_eos=True), drafter=drafter,
                  spec=SpecConfig(k=4))
    assert spec.token_ids == plain.token_ids and spec.stats.tau > 1.5
    assert isinstance(drafter, BlockDrafter)


def test_resume_continues_exactly(setup, tmp_path):
    path, _, seqs = setup
    assert train_block_drafter(path / "target", seqs, tmp_path / "a", cfg(), 3, progress=False, stop_at=3) is None
    a = train_block_drafter(path / "target", seqs, tmp_path / "a", cfg(), 3, progress=False)
    b = train_block_drafter(path / "target", seqs, tmp_path / "b", cfg(), 3, progress=False)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name


def test_warm_start_begins_from_the_shipped_weights(setup, tmp_path):
    """--init-from: training starts from the given drafter's weights (at lr 0 they stay: weight decay is scaled
    by lr too), and a drafter of another architecture is refused by name."""
    from verispec.errors import CheckpointError

    path, target, seqs = setup
    save_block_drafter(train_block_drafter(path / "target", seqs, tmp_path / "a", cfg(), 3, progress=False),
                       tmp_path / "shipped")
    shipped = read_block_drafter(tmp_path / "shipped", target.config).state_dict()
    warm = cfg(lr=0.0, init_from=str(tmp_path / "shipped"))
    model = train_block_drafter(path / "target", seqs, tmp_path / "b", warm, 3, progress=False)
    for name, w in model.state_dict().items():
        assert torch.equal(w, shipped[name]), name
    other = cfg(markov_rank=4, init_from=str(tmp_path / "shipped"))
    with pytest.raises(CheckpointError, match="block config"):
        train_block_drafter(path / "target", seqs, tmp_path / "c", other, 3, progress=False)
    # the warm-started drafter ships its source's draft vocabulary (stage 2 drafts as the shipped drafter does)
    from verispec.train.block_recipe import carry_draft_vocab

    (tmp_path / "out").mkdir()
    assert not carry_draft_vocab(str(tmp_path / "shipped"), tmp_path / "out")  # none to carry
    vocab = '{"token_ids": [1, 2, 3]}'
    (tmp_path / "shipped" / "draft_vocab.json").write_text(vocab)
    assert carry_draft_vocab(str(tmp_path / "shipped"), tmp_path / "out")
    assert (tmp_path / "out" / "draft_vocab.json").read_text() == vocab
    assert not carry_draft_vocab(None, tmp_path / "out")


def test_ablation_claims_are_computed_from_the_numbers():
    from verispec.bench.ablation import claims, markdown

    def rec(arm, kind, loss, g, taus, ece=None):
        r = {"arm": arm, "kind": kind, "loss": loss, "block_size": g, "held_out": {"accuracy": 0.5, "tau": 2.0,
             "per_pos": [0.5] * g}, "tasks": {t: {"tau": v} for t, v in zip(("a", "b"), taus)}}
        r["tau_mean"] = float(np.mean(taus))
        if ece:
            r["ece_before"], r["ece_after"] = ece
        return r

    results = [rec("par16-ce+decay", "block", "ce+decay", 16, (2.0, 2.2)), rec("par16-auf", "block", "auf", 16, (2.1, 2.1)),
               rec("par16-auf+decay", "block", "auf+decay", 16, (2.12, 2.11)),
               rec("par8-dspark", "block", "dspark", 8, (2.0, 2.0), (0.05, 0.01)),
               rec("sar8-dspark", "dspark", "dspark", 8, (2.2, 2.2), (0.06, 0.03))]
    got = {c["claim"].split(" (")[0]: c["holds"] for c in claims(results)}
    assert got == {"AUF raises tau over the decay-weighted baseline on every task": False,
                   "decay weighting is inert once AUF is on": True,
                   "semi-autoregressive beats parallel and the gap grows with gamma": True,
                   "ECE after STS is about 1-2%": False}
    assert "sar8-dspark" in markdown({"config": {"steps": 1, "prompts_per_task": 1}, "results": results,
                                      "claims": claims(results)})
    rnn = "the RNN head gains little over the Markov head, mostly at long gamma"
    with_rnn = results + [rec("rnn8-dspark", "dspark", "dspark", 8, (2.25, 2.25))]  # +2.3%: marginal
    assert {c["claim"].split(" (")[0]: c["holds"] for c in claims(with_rnn)}[rnn] is True
    with_rnn += [rec("sar16-dspark", "dspark", "dspark", 16, (2.4, 2.4)), rec("rnn16-dspark", "dspark", "dspark", 16,
                                                                              (2.41, 2.41))]  # less gain at 16
    assert {c["claim"].split(" (")[0]: c["holds"] for c in claims(with_rnn)}[rnn] is False


def test_target_dtype_is_a_choice(setup, tmp_path):
    """The frozen target may run in bf16 (as served) or fp32 (fast on CPUs without native bf16); nothing else."""
    path, _, seqs = setup
    for dtype in ("fp32", "bf16"):
        c = cfg(target_dtype=dtype, max_steps=2)
        model = train_block_drafter(path / "target", seqs, tmp_path / dtype, c, 3, progress=False)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    with pytest.raises(ValueError, match="target_dtype"):
        cfg(target_dtype="fp16")
