"""Quantization-aware distillation (`verispec train qad`, verispec.train.qad) on a tiny fp32 model: the STE forward is
the quantized model's forward on the fixed grid, a few steps lower the KL to the teacher, a resumed run equals an
uninterrupted one, the result is a pack-quantized checkpoint on the starting grid, and a bad --init is one error line.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import tiny_model
from safetensors.torch import load_file

from verispec.cli import main
from verispec.errors import CheckpointError, ConfigError
from verispec.model.checkpoint import load_model, save_model
from verispec.quant.convert import QuantizeConfig, quantize_checkpoint
from verispec.quant.linear import QuantLinear
from verispec.quant.rtn import dequantize, quantize_rtn
from verispec.train.qad import QADConfig, build_student, fake_quant_modules, kl_per_token, train_qad

W4 = QuantizeConfig(scheme="w4a16", group_size=32)
CFG = QADConfig(scheme="w4a16", group_size=32, seq_len=32, batch_size=4, lr=1e-3, warmup_steps=2, max_steps=12,
                dtype="fp32", eval_every=4, eval_windows=4)
TOKENS = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6], [3, 44, 17, 90, 2, 61, 28, 1, 2, 3, 4, 5, 6, 7]])


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    save_model(tiny_model(0, 0.2), d)
    return d


@pytest.fixture(scope="module")
def rtn_dir(dense_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("rtn")
    quantize_checkpoint(dense_dir, d, W4, progress=False)
    return d


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """DATA/tokens/{train,val}.bin: a random walk over the tiny vocabulary (ids < 97)."""
    d = tmp_path_factory.mktemp("data")
    (d / "tokens").mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 20_000), ("val", 2_000)):
        walk = np.cumsum(rng.integers(-3, 4, size=n)) % 97
        walk.astype(np.uint16).tofile(d / "tokens" / f"{split}.bin")
    return d


def _run(teacher, init, tmp_path, name, data_dir, cfg=CFG, stop_at=None):
    return train_qad(teacher, init, tmp_path / name / "run", tmp_path / name / "model", cfg,
                     tokens=data_dir / "tokens", progress=False, stop_at=stop_at)


def test_ste_forward_is_the_quantized_models_forward(dense_dir, rtn_dir):
    """Started from a pack-quantized copy, the student's int values are the copy's, its forward weights are their
    dequantization bit for bit, its logits are the loaded quantized model's; gradients reach the latent weights."""
    student, _ = build_student(rtn_dir, CFG.quant_scheme)
    qmodel = load_model(rtn_dir, "fp32")
    fq = fake_quant_modules(student)
    assert len(fq) == 7 * 2
    for name, m in fq.items():
        lin = qmodel.get_submodule(name)
        assert isinstance(lin, QuantLinear) and torch.equal(m.quantized(), lin.qweight)
        assert torch.equal(m.weight_scale, lin.scales)
        x = torch.eye(m.in_features)  # the forward's weight, column by column
        assert torch.equal(m(x).T, dequantize(lin.qweight, lin.scales))
    with torch.no_grad():
        torch.testing.assert_close(student(TOKENS)[0], qmodel(TOKENS)[0], rtol=1e-5, atol=1e-5)
    # Started from the dense model: the RTN grid and values, computed at start.
    dense_student, _ = build_student(dense_dir, CFG.quant_scheme)
    dense = load_model(dense_dir, "fp32", pack=False)
    for name, m in fake_quant_modules(dense_student).items():
        q, s = quantize_rtn(dense.get_submodule(name).weight, CFG.quant_scheme, torch.float32)
        assert torch.equal(m.quantized(), q) and torch.equal(m.weight_scale, s)
    teacher_logits = load_model(dense_dir, "fp32")(TOKENS)[0].detach()
    kl_per_token(teacher_logits, student(TOKENS)[0]).backward()
    grads = [m.weight.grad for m in fq.values()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)  # straight through round()
    assert all(not p.requires_grad for n, p in student.named_parameters() if "proj" not in n)  # embeddings, norms


def test_a_few_steps_lower_the_kl(dense_dir, rtn_dir, data_dir, tmp_path):
    summary = _run(dense_dir, rtn_dir, tmp_path, "a", data_dir)
    kl = [e["kl"] for e in summary["heldout_kl"]]
    assert [e["step"] for e in summary["heldout_kl"]] == [0, 4, 8, 12]
    assert kl[-1] < 0.8 * kl[0], kl
    assert 0 < summary["values_changed"] < 0.5 and summary["steps"] == 12


def test_resume_equals_uninterrupted_run(dense_dir, rtn_dir, data_dir, tmp_path):
    cfg = replace(CFG, max_steps=6)
    whole = _run(dense_dir, rtn_dir, tmp_path, "whole", data_dir, cfg)
    assert _run(dense_dir, rtn_dir, tmp_path, "parts", data_dir, cfg, stop_at=3) is None
    assert not (tmp_path / "parts" / "model").exists()
    parts = _run(dense_dir, rtn_dir, tmp_path, "parts", data_dir, cfg)
    a, b = (load_file(tmp_path / n / "model" / "model.safetensors") for n in ("whole", "parts"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert whole["heldout_kl"] == parts["heldout_kl"] and whole["values_changed"] == parts["values_changed"] > 0
    # A resumed run must not silently change what it trains.
    with pytest.raises(ConfigError, match="lr"):
        _run(dense_dir, rtn_dir, tmp_path, "parts", data_dir, replace(cfg, lr=1e-4))


def test_written_checkpoint_loads_on_the_fixed_grid(dense_dir, rtn_dir, data_dir, tmp_path):
    _run(dense_dir, rtn_dir, tmp_path, "a", data_dir)
    out = tmp_path / "a" / "model"
    start, trained = load_file(rtn_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert start.keys() == trained.keys()
    moved = 0
    for k in start:
        if k.endswith("weight_packed"):
            moved += not torch.equal(start[k], trained[k])
        else:  # scales, shapes, embeddings and norms: unchanged
            assert start[k].dtype == trained[k].dtype and torch.equal(start[k], trained[k]), k
    assert moved > 0
    model = load_model(out, "fp32")
    assert model.quantized and isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)
    student, _ = build_student(out, CFG.quant_scheme)  # and it reads back as the same fixed grid
    with torch.no_grad():
        torch.testing.assert_close(student(TOKENS)[0], model(TOKENS)[0], rtol=1e-5, atol=1e-5)
    assert (out / "quantization.json").is_file()


def test_cli_trains_and_bad_init_is_one_error_line(dense_dir, rtn_dir, data_dir, tmp_path, capsys):
    base = ["train", "qad", "--teacher", str(dense_dir), "--group-size", "32", "--data-dir", str(data_dir),
            "--seq-len", "16", "--batch-size", "2", "--max-steps", "2", "--out", str(tmp_path / "run")]
    assert main([*base, "--init", str(rtn_dir), "--save", str(tmp_path / "q")]) == 0
    assert "wrote" in capsys.readouterr().out and load_model(tmp_path / "q").quantized
    bad_config = tmp_path / "badcfg"
    bad_config.mkdir()
    (bad_config / "config.json").write_text("{not json")
    other = tmp_path / "other"
    save_model(tiny_model(0, 0.2, hidden_size=32, head_dim=8), other)
    for init in (tmp_path / "missing", bad_config, other):
        assert main([*base, "--init", str(init), "--out", str(tmp_path / "r2")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and str(init) in err[0], err
    with pytest.raises(ConfigError, match="group 32"):  # a grid other than the one asked for
        build_student(rtn_dir, replace(CFG, group_size=64).quant_scheme)
    with pytest.raises(CheckpointError):
        build_student(tmp_path / "missing", CFG.quant_scheme)


def test_qad_refuses_int8_activation_schemes():
    """QAD's student rounds its weights only: training it for a w4a8 target would distil a different model."""
    with pytest.raises(ConfigError, match="weight-only"):
        QADConfig(scheme="w4a8")
