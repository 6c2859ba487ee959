"""The drafter for a quantized target (issue 20, "Quantize the Drafter"), on tiny fp32 models.

Stage 2 of the drafter recipe: `verispec train drafter --target QUANTDIR --init-from DRAFTER` fine-tunes a drafter
on the quantized target's own continuations and hidden states, keys its continuation cache by that target, and
records the target in the drafter it ships. Drafters quantized themselves (`verispec quantize` on a dspark or a
draft-model directory) load as `dspark:DIR` / `model:DIR` and keep speculation exact.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _checkpoints import edited_copy
from conftest import TOKENIZER_TEXT, tiny_model
from test_feature_drafters import make_feature
from safetensors.torch import load_file

import verispec.train.block as train_block
import verispec.train.drafter as train_drafter_mod
from verispec.cli import main
from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import build_drafter
from verispec.drafters.feature import save_feature_drafter
from verispec.errors import CheckpointError
from verispec.kernels import native
from verispec.model import load_model, save_model
from verispec.model.tokenizer import Tokenizer
from verispec.quant.convert import QuantizeConfig, quantize_checkpoint
from verispec.quant.linear import QuantLinear
from verispec.train.drafter import (
    TrainConfig, continuations_file, draft_architecture, target_continuations, target_fingerprint, train_drafter,
)

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
W4 = QuantizeConfig(scheme="w4a16", group_size=32)


def _drafter(spec: str, target):
    return build_drafter(spec, target=target, dtype=torch.float32, device=torch.device("cpu"))


def _tokenizer() -> Tokenizer:
    """The conftest tokenizer's recipe plus the block drafters' `<|mask|>` token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>", "<|mask|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    return Tokenizer(tok, eos_token_ids=(tok.token_to_id("<eos>"),))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny 8-layer target (the recipe's drafters read its layers 2, 4, 6), its w4a16 copy, and a data dir with
    token files (random ids: the recipe only needs prompts)."""
    root = tmp_path_factory.mktemp("qdraft")
    tok = _tokenizer()
    target = tiny_model(0, 0.2, vocab_size=tok.vocab_size, num_hidden_layers=8, max_position_embeddings=512)
    save_model(target, root / "target")
    tok.save(root / "target")
    quantize_checkpoint(root / "target", root / "w4", W4, progress=False)
    data = root / "data"
    (data / "corpus").mkdir(parents=True)
    (data / "corpus" / "manifest.json").write_text("{}")
    (data / "tokenizer").mkdir()
    tok.save(data / "tokenizer")
    (data / "tokens").mkdir()
    rng = np.random.default_rng(0)
    for split in ("train", "val", "bench"):
        rng.integers(4, tok.vocab_size, size=20_000).astype(np.uint16).tofile(data / "tokens" / f"{split}.bin")
    return root


def _train(world, target: str, out: str, *extra: str) -> int:
    return main(["train", "drafter", "--kind", "dspark", "--target", str(world / target), "--data-dir",
                 str(world / "data"), "--max-steps", "2", "--num-sequences", "8", "--dtype", "fp32", "--anchors", "4",
                 "--out", str(world / "runs" / out), "--zoo-dir", str(world / "zoo" / out), *extra])


@pytest.fixture(scope="module")
def stage1(world):
    """A dspark drafter trained for the dense target (stage 1, two steps)."""
    assert _train(world, "target", "dense") == 0
    return world / "zoo" / "dense"


def test_stage2_fine_tunes_on_the_quantized_target(world, stage1, monkeypatch):
    loaded = []

    def spy(load):
        def wrapped(*args, **kwargs):
            loaded.append(load(*args, **kwargs))
            return loaded[-1]
        return wrapped

    monkeypatch.setattr(train_block, "load_model", spy(train_block.load_model))
    monkeypatch.setattr(train_drafter_mod, "load_model", spy(train_drafter_mod.load_model))
    assert _train(world, "w4", "stage2", "--init-from", str(stage1)) == 0
    # The frozen target of training (and of its continuations) is the quantized model.
    assert loaded and all(m.quantized for m in loaded)
    assert all(isinstance(m.model.layers[0].mlp.down_proj, QuantLinear) for m in loaded)

    # Its continuations are cached under its own key, and they are the quantized model's greedy text.
    runs = world / "data" / "runs"
    dense_file, quant_file = (continuations_file(world / t, runs, "train", "fp32") for t in ("target", "w4"))
    assert dense_file != quant_file and dense_file.is_file() and quant_file.is_file()
    dense_rows, quant_rows = (np.fromfile(f, dtype=np.uint16).reshape(-1, 256) for f in (dense_file, quant_file))
    assert np.array_equal(dense_rows[:, :128], quant_rows[:, :128])  # the same prompts
    assert not np.array_equal(dense_rows[:, 128:], quant_rows[:, 128:])  # continued by different models
    qmodel = load_model(world / "w4", "fp32")
    prompt = quant_rows[0, :128].tolist()
    want = decode(qmodel, prompt, SamplingParams(max_tokens=128, ignore_eos=True)).token_ids
    assert quant_rows[0, 128:].tolist() == want

    # The drafter warm-started from stage 1, records its target, loads and drafts losslessly on it.
    meta = json.loads((world / "zoo" / "stage2" / "config.json").read_text())
    assert meta["trained_for"]["fingerprint"] == target_fingerprint(world / "w4") != target_fingerprint(
        world / "target")
    assert meta["trained_for"]["quantization"] == "w4a16-g32"
    assert meta["training"]["config"]["init_from"] == str(stage1)
    assert "w4a16-g32" in (world / "zoo" / "stage2" / "README.md").read_text()
    drafter = _drafter(f"dspark:{world / 'zoo' / 'stage2'}", qmodel)
    for p in ([5, 9, 17, 33, 60], prompt[:40]):
        assert decode(qmodel, p, GREEDY, drafter=drafter, spec=SpecConfig(k=4)).token_ids == \
            decode(qmodel, p, GREEDY).token_ids


def test_a_run_dir_belongs_to_one_target(world, stage1, capsys):
    """Resuming the dense target's run for the quantized copy is refused with one error line."""
    assert _train(world, "w4", "dense", "--init-from", str(stage1)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "holds a run for target" in err[0]


def test_default_dirs_of_another_target_do_not_overwrite_the_zoo(world, stage1, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "drafter", "--kind", "dspark", "--target", str(world / "w4"), "--data-dir",
                 str(world / "data"), "--max-steps", "1", "--num-sequences", "8", "--dtype", "fp32",
                 "--anchors", "2", "--init-from", str(stage1)]) == 0
    assert (tmp_path / "zoo" / "dspark-w4" / "config.json").is_file()
    assert (world / "data" / "runs" / "dspark-w4" / "target.json").is_file()


def test_draft_model_stage2_warm_starts_on_the_quantized_target(world, tmp_path):
    """--kind model --init-from: the draft model's loop, its architecture taken from the source drafter."""
    tok = Tokenizer.from_dir(world / "target")
    draft = tiny_model(5, 0.2, vocab_size=tok.vocab_size, max_position_embeddings=512)
    save_model(draft, tmp_path / "drafter")
    arch = draft_architecture(tmp_path / "drafter")
    cfg = TrainConfig(seq_len=255, batch_size=4, lr=1e-3, warmup_steps=1, max_steps=2, eval_every=2, eval_windows=2,
                      model=arch, init_from=str(tmp_path / "drafter"))
    # The run dir's continuation cache is keyed by the target (it was one continuations.u16 for any target).
    (tmp_path / "run").mkdir()
    np.zeros((4, 256), dtype=np.uint16).tofile(tmp_path / "run" / "continuations.u16")  # a stale bf16-era cache
    out = train_drafter(world / "w4", world / "data" / "tokens", tmp_path / "run", cfg, num_sequences=4,
                        progress=False)
    cont = tmp_path / "run" / f"continuations-{target_fingerprint(world / 'w4')}.u16"
    rows = np.fromfile(cont, dtype=np.uint16).reshape(-1, 256)
    qmodel = load_model(world / "w4", "fp32")
    assert rows[0, 128:].tolist() == decode(qmodel, rows[0, :128].tolist(),
                                            SamplingParams(max_tokens=128, ignore_eos=True)).token_ids
    assert json.loads((tmp_path / "run" / "target.json").read_text())["quantization"] == "w4a16-g32"
    tok.save(out)
    drafter = _drafter(f"model:{out}", qmodel)
    p = [5, 9, 17, 33, 60]
    assert decode(qmodel, p, GREEDY, drafter=drafter, spec=SpecConfig(k=3)).token_ids == \
        decode(qmodel, p, GREEDY).token_ids
    with pytest.raises(CheckpointError, match="quantized"):
        draft_architecture(world / "w4")


def test_a_quantized_targets_key_covers_its_whole_file(tmp_path):
    """Two quantized copies that agree on their first MiB (header, dense tensors) but not after it get different
    continuation keys; a dense checkpoint keeps its old key (size and first MiB), so existing caches stay valid."""
    keys = {}
    for name, last in (("a", b"a"), ("b", b"b")):
        for kind, cfg in (("q", {"quantization_config": {}}), ("d", {})):
            d = tmp_path / f"{kind}{name}"
            d.mkdir()
            (d / "config.json").write_text(json.dumps(cfg))
            (d / "model.safetensors").write_bytes(bytes(2 << 20) + last)
            keys[kind + name] = target_fingerprint(d)
    assert keys["qa"] != keys["qb"] and keys["da"] == keys["db"]


@pytest.mark.parametrize("k", [2, 4])
def test_quantized_dspark_drafter_loads_and_stays_exact(world, stage1, tmp_path, capsys, k):
    out = tmp_path / "dspark-w4"
    assert main(["quantize", str(stage1), "--out", str(out), "--scheme", "w4a16", "--group-size", "32"]) == 0
    meta = json.loads((out / "config.json").read_text())
    assert meta["quantization_config"]["ignore"] == ["markov_out", "confidence_head", "rnn_cell"]
    state = load_file(str(out / "model.safetensors"))
    assert "fc.weight_packed" in state and "layers.0.mlp.down_proj.weight_packed" in state
    assert "markov_out.weight" in state and "markov_in.weight" in state
    qmodel = load_model(world / "w4", "fp32")
    drafter = _drafter(f"dspark:{out}", qmodel)
    assert isinstance(drafter.model.fc, QuantLinear) and drafter.model.layers[0].qkv_quant is not None
    dense = _drafter(f"dspark:{stage1}", qmodel)
    prompts = [[5, 9, 17, 33, 60, 7, 7, 21], list(range(4, 60))]
    for p in prompts:
        ref = decode(qmodel, p, GREEDY).token_ids
        r = decode(qmodel, p, GREEDY, drafter=drafter, spec=SpecConfig(k=k))
        assert r.token_ids == ref
        assert decode(qmodel, p, GREEDY, drafter=dense, spec=SpecConfig(k=k)).token_ids == ref
    # A warm start from it is refused (stage 2 starts from the dense drafter).
    with pytest.raises(CheckpointError, match="quantized"):
        train_block.warm_start(train_block.BlockDraftModel(qmodel.config, drafter.model.config), out, qmodel.config)
    assert main(["quantize", str(stage1), "--out", str(tmp_path / "g"), "--scheme", "w4a16", "--method",
                 "gptq"]) == 2
    assert "--method rtn" in capsys.readouterr().err


def test_quantized_draft_model_loads_and_stays_exact(world, tmp_path, capsys):
    tok = Tokenizer.from_dir(world / "target")
    save_model(tiny_model(3, 0.2, vocab_size=tok.vocab_size, intermediate_size=96), tmp_path / "drafter")
    # 96 input features: a group of 64 does not fit, and the error says which do.
    assert main(["quantize", str(tmp_path / "drafter"), "--out", str(tmp_path / "q"), "--scheme", "w4a16",
                 "--group-size", "64"]) == 2
    assert "use --group-size 32" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "drafter"), "--out", str(tmp_path / "q"), "--scheme", "w4a16",
                 "--group-size", "32"]) == 0
    qmodel = load_model(world / "w4", "fp32")
    drafter = _drafter(f"model:{tmp_path / 'q'}", qmodel)
    assert drafter.model.quantized
    for p in ([5, 9, 17, 33, 60], list(range(4, 50))):
        for k in (1, 4):
            assert decode(qmodel, p, GREEDY, drafter=drafter, spec=SpecConfig(k=k)).token_ids == \
                decode(qmodel, p, GREEDY).token_ids


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
@pytest.mark.parametrize("scheme", ["w4a16", "w4a8"])
def test_quantized_feature_drafters_load_and_stay_exact(world, tmp_path, capsys, kind, scheme):
    """EAGLE-3 and MTP drafters quantize like block drafters (their input projection and decoder layer; EAGLE's fc
    too), draft by the native one-call step over the int4 packs, and leave the output the target's."""
    qmodel = load_model(world / "w4", "fp32")
    save_feature_drafter(make_feature(qmodel, kind), tmp_path / "d")
    out = tmp_path / "q"
    assert main(["quantize", str(tmp_path / "d"), "--out", str(out), "--scheme", scheme, "--group-size", "32"]) == 0
    state = load_file(str(out / "model.safetensors"))
    assert "w_in.weight_packed" in state and "layer.mlp.down_proj.weight_packed" in state
    assert ("fc.weight_packed" in state) == (kind == "eagle") and "layer.input_layernorm.weight" in state
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == []  # every Linear
    drafter = _drafter(f"{kind}:{out}", qmodel)
    assert isinstance(drafter.model.w_in, QuantLinear) and drafter.model.layer.self_attn.qkv_quant is not None
    with torch.no_grad():  # the native step serves inference only
        assert (drafter._native() is not None) == native.qavailable()
    dense = _drafter(f"{kind}:{tmp_path / 'd'}", qmodel)
    for p in ([5, 9, 17, 33, 60, 7, 7, 21], list(range(4, 50))):
        ref = decode(qmodel, p, GREEDY).token_ids
        for k in (1, 4):
            assert decode(qmodel, p, GREEDY, drafter=drafter, spec=SpecConfig(k=k)).token_ids == ref
        assert decode(qmodel, p, GREEDY, drafter=dense, spec=SpecConfig(k=4)).token_ids == ref
    bad = edited_copy(out, tmp_path / "bad", lambda m, s: s.pop("layer.self_attn.o_proj.weight_scale"))
    with pytest.raises(CheckpointError, match="layer.self_attn.o_proj.weight_scale"):
        _drafter(f"{kind}:{bad}", qmodel)


BAD = {
    "scale": (lambda m, s: s.pop("layers.0.o_proj.weight_scale"), "missing tensor layers.0.o_proj.weight_scale"),
    "shape": (lambda m, s: s.update({"fc.weight_shape": torch.tensor([64, 64])}), "fc.weight_shape"),
    "markov": (lambda m, s: m["quantization_config"].update(ignore=[]), "quantized markov_out"),
    "scheme": (lambda m, s: m["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=3),
               "num_bits 3"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_quantized_drafter_fails_with_one_error(world, stage1, tmp_path, capsys, case):
    good = tmp_path / "good"
    assert main(["quantize", str(stage1), "--out", str(good), "--scheme", "w4a16", "--group-size", "32"]) == 0
    edit, words = BAD[case]
    edited_copy(good, tmp_path / "bad", edit)
    capsys.readouterr()
    assert main(["generate", "--target", str(world / "w4"), "--drafter", f"dspark:{tmp_path / 'bad'}",
                 "--prompt", "def add", "--max-tokens", "2", "--dtype", "fp32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and words in err[0], err
