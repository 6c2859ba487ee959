"""Byte-level BPE training with Hugging Face `tokenizers`."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from verispec.model.tokenizer import Tokenizer

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>")


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    """Special tokens get ids 0..len-1 (bos, eos, pad, mask by default)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    eos = tok.token_to_id(special_tokens[1]) if len(special_tokens) > 1 else None
    bos = tok.token_to_id(special_tokens[0]) if special_tokens else None
    return Tokenizer(tok, eos_token_ids=(eos,) if eos is not None else (), bos_token_id=bos)


def save_tokenizer(tokenizer: Tokenizer, path: str | Path, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> None:
    """tokenizer.json plus a tokenizer_config.json naming the special tokens, as transformers expects."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(path)
    bos, eos, pad, *rest = special_tokens
    meta = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
            "add_bos_token": False}
    if rest:
        meta["mask_token"] = rest[0]
    (path / "tokenizer_config.json").write_text(json.dumps(meta, indent=2) + "\n")
