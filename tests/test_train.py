"""Training recipes at toy scale: resuming from a checkpoint continues exactly, and a run ends in a loadable
Hugging Face checkpoint."""

from __future__ import annotations

import json

import numpy as np
import torch

from verispec.model import load_model
from verispec.train.data import TokenWindows
from verispec.train.target import TrainConfig, train_lm

TOY = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
           tie_word_embeddings=True, eos_token_id=(1,), bos_token_id=0)


def _windows(tmp_path, seq_len=16):
    rng = np.random.default_rng(0)
    path = tmp_path / "tokens.bin"
    rng.integers(0, 64, size=4000).astype(np.uint16).tofile(path)
    return TokenWindows(path, seq_len, seed=0)


def _run(tmp_path, out, cfg, stop_at=None):
    w = _windows(tmp_path)
    return train_lm(TrainConfig(**cfg), lambda s: w.batch(s, 2), w, out, "toy", progress=False, stop_at=stop_at)


def test_resume_continues_exactly(tmp_path):
    """Stop at step 4, resume to 8 == 8 steps in one go: same weights (model and AdamW state), same losses."""
    cfg = dict(seq_len=16, batch_size=2, lr=1e-2, warmup_steps=2, max_steps=8, eval_every=4, eval_windows=2,
               model=TOY)
    assert _run(tmp_path, tmp_path / "a", cfg, stop_at=4) is None
    assert not (tmp_path / "a" / "model").exists()
    _run(tmp_path, tmp_path / "a", cfg)
    _run(tmp_path, tmp_path / "b", cfg)
    a = load_model(tmp_path / "a" / "model")
    b = load_model(tmp_path / "b" / "model")
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    log_a = json.loads((tmp_path / "a" / "train_log.json").read_text())
    log_b = json.loads((tmp_path / "b" / "train_log.json").read_text())
    assert [e["train_loss"] for e in log_a] == [e["train_loss"] for e in log_b]
    assert len(log_a) == 8 and "val_loss" in log_a[3]


def test_training_reduces_loss(tmp_path):
    """On a repeating token stream the loss falls well below uniform (ln 64 = 4.16)."""
    path = tmp_path / "rep.bin"
    np.tile(np.arange(10, dtype=np.uint16), 500).tofile(path)
    w = TokenWindows(path, 16, seed=0)
    cfg = TrainConfig(seq_len=16, batch_size=4, lr=1e-2, warmup_steps=5, max_steps=60, eval_every=60,
                      eval_windows=4, model=TOY)
    train_lm(cfg, lambda s: w.batch(s, 4), w, tmp_path / "r", "toy", progress=False)
    log = json.loads((tmp_path / "r" / "train_log.json").read_text())
    assert log[-1]["val_loss"] < 1.0 < log[0]["train_loss"]


def test_warm_start_begins_from_the_given_weights(tmp_path):
    """A second stage (init_from) starts from the first stage's weights: with lr 0 it keeps them exactly, and its
    log counts tokens from the data offset on."""
    cfg = dict(seq_len=16, batch_size=2, lr=1e-2, warmup_steps=2, max_steps=6, eval_every=6, eval_windows=2,
               model=TOY)
    first = _run(tmp_path, tmp_path / "a", cfg)
    second = _run(tmp_path, tmp_path / "b", {**cfg, "lr": 0.0, "max_steps": 2, "init_from": str(first),
                                             "data_offset": 6})
    a, b = load_model(first), load_model(second)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    log = json.loads((tmp_path / "b" / "train_log.json").read_text())
    assert [e["tokens"] for e in log] == [(6 + i) * 32 for i in (1, 2)]
