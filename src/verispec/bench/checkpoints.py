"""Random-init checkpoints for benchmarks and demos when no trained model is at hand."""

from __future__ import annotations

from pathlib import Path

import torch

from verispec.config import ModelConfig
from verispec.model import Transformer, save_model

# ~49M parameters (d512, 14 layers, 8k vocabulary, tied): the size machine.md measures HF and llama.cpp at.
RANDOM_50M = dict(
    model_type="llama", vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=14,
    num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
    tie_word_embeddings=True, eos_token_id=(1,), bos_token_id=0, pad_token_id=2,
)
# A tiny model whose cost is almost all per-forward overhead.
RANDOM_TINY = dict(
    model_type="llama", vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=32, max_position_embeddings=2048,
    tie_word_embeddings=False, eos_token_id=(1,), bos_token_id=0, pad_token_id=2,
)


def _stdlib_sample(max_bytes: int = 3_000_000) -> list[str]:
    """A few MB of the running interpreter's standard library source (PSF licence), for a quick tokenizer."""
    import sysconfig

    texts, total = [], 0
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def make_random_checkpoint(path: str | Path, spec: dict, seed: int = 0, std: float = 0.02) -> Path:
    """Save a random-init model (fp32) with a BPE tokenizer of its vocabulary size, once; reuse it after."""
    from verispec.train.tokenizer import save_tokenizer, train_bpe

    path = Path(path)
    if (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file():
        return path
    save_tokenizer(train_bpe(_stdlib_sample(), spec["vocab_size"]), path)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**spec))
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            continue
        torch.nn.init.normal_(p, std=std)
    save_model(model, path)
    return path


if __name__ == "__main__":
    import sys

    make_random_checkpoint(sys.argv[1], RANDOM_50M)
