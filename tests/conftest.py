"""Tiny random fp32 models and a tiny byte-level BPE tokenizer, shared by the tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from verispec.config import ModelConfig
from verispec.model import Transformer, save_model
from verispec.model.tokenizer import Tokenizer

TOKENIZER_TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "The quick brown fox jumps over the lazy dog. Speculative decoding is exact.\n"
    "naïve café – ünïcödé ✓ 日本語のテキスト 🙂\n"
) * 4


def pytest_configure(config) -> None:
    # Tiny models gain nothing from a second thread, and parallel runs of the suite would oversubscribe.
    torch.set_num_threads(1)


def no_native_reason() -> str:
    """The skip reason of a test that needs verispec's native kernels (verispec.kernels): why they are off in this
    process, and what turns them on."""
    from verispec.kernels import native

    if os.environ.get("VERISPEC_NATIVE", "1") == "0" or os.environ.get("VERISPEC_KERNELS") == "off":
        why = "VERISPEC_NATIVE=0 or VERISPEC_KERNELS=off turns them off: unset it"
    else:
        try:
            runnable = native.cpu_features()
        except (OSError, RuntimeError) as e:  # no C compiler, or the CPU probe did not build
            why = f"{e}: install a C compiler (gcc or clang, or point $CC at one)"
        else:
            why = ("this CPU has no AVX2 + FMA (x86-64 only)" if not runnable else
                   f"this CPU runs {', '.join(sorted(runnable))} but the kernels did not build or load "
                   f"(VERISPEC_KERNELS={os.environ.get('VERISPEC_KERNELS', 'auto')}; verispec's warning says why)")
    return f"needs verispec's native CPU kernels (x86-64 with AVX2 + FMA, and a C compiler): {why}"


def tiny_config(vocab_size: int = 97, model_type: str = "llama", **kw) -> ModelConfig:
    base = dict(
        model_type=model_type, vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128, eos_token_id=(),
    )
    base["attention_bias"] = model_type == "qwen2"  # HF's Qwen2 always has q/k/v biases
    base.update(kw)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, std: float = 0.2, **kw) -> Transformer:
    """A random fp32 model. std=0.2 (not 0.02) keeps argmax sequences non-degenerate (machine.md §5).

    Prepared as `load_model` prepares a model for inference (fused projections, packed weights), so the tests
    run the matmuls that ship."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**kw))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    return model.eval().fuse_projections().pack_weights()


def tiny_continuations(path, n: int = 24, prompt_len: int = 8, new_tokens: int = 24):
    """A tiny target saved under path/target and n of its own greedy continuations [n, prompt_len + new_tokens]
    (uint16), the data the drafter trainers learn from."""
    import numpy as np

    from verispec.config import SamplingParams
    from verispec.decode import decode

    target = tiny_model(0, 0.2)
    save_model(target, path / "target")
    rng = np.random.default_rng(0)
    seqs = []
    for _ in range(n):
        prompt = rng.integers(4, 97, size=prompt_len).tolist()
        seqs.append(prompt + decode(target, prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True)).token_ids)
    return path, target, np.array(seqs, dtype=np.uint16)


def make_tokenizer(vocab_size: int = 320) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer)
    return Tokenizer(tok, eos_token_ids=(tok.token_to_id("<eos>"),))


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return make_tokenizer()


@pytest.fixture
def model() -> Transformer:
    return tiny_model()


@pytest.fixture
def checkpoint_dir(tmp_path, tokenizer):
    """A saved tiny checkpoint with a tokenizer.json, whose vocabulary matches the tokenizer."""
    m = tiny_model(vocab_size=tokenizer.vocab_size)
    save_model(m, tmp_path / "target")
    tokenizer.save(tmp_path / "target")
    return tmp_path / "target"
