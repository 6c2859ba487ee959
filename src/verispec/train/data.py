"""Token streams for training: each split tokenized once into a flat uint16 file, documents framed as
<bos> text <eos>, and random fixed-length windows drawn from it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from verispec.model.tokenizer import Tokenizer
from verispec.train.corpus import read_split


def tokenize_split(corpus: Path, split: str, tokenizer: Tokenizer, out: Path, batch: int = 256) -> int:
    """Write out (uint16 token ids) and return its length in tokens."""
    return write_tokens([d.text for d in read_split(corpus, split)], tokenizer, out, batch=batch)


def write_tokens(texts: Sequence[str], tokenizer: Tokenizer, out: Path, cap: int | None = None,
                 batch: int = 256) -> int:
    """Texts tokenized in order, each framed by the tokenizer's <bos> and first <eos> where it has them, written to
    out as uint16 ids (at most `cap` of them: later texts are not tokenized); returns the count written."""
    if tokenizer.vocab_size > 65535:
        raise ValueError("uint16 token files need a vocabulary below 65536")
    head = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    tail = tokenizer.eos_token_ids[:1] if tokenizer.eos_token_ids else []
    chunks: list[np.ndarray] = []
    n = 0
    for i in range(0, len(texts), batch):
        for ids in tokenizer.encode_batch(list(texts[i : i + batch])):
            chunks.append(np.asarray([*head, *ids, *tail], dtype=np.uint16))
            n += chunks[-1].size
        if cap is not None and n >= cap:
            break
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    tokens = tokens[:cap] if cap is not None else tokens
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tokens.tofile(tmp)
    tmp.replace(out)
    return int(tokens.size)


class TokenWindows:
    """Random windows of `seq_len + 1` tokens from a token file; batch b of step s is a pure function of
    (seed, s), so a resumed run sees exactly the batches it would have seen."""

    def __init__(self, path: Path, seq_len: int, seed: int = 0) -> None:
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if self.tokens.size <= seq_len + 1:
            raise ValueError(f"{path} holds {self.tokens.size} tokens, fewer than one window of {seq_len + 1}")
        self.seq_len, self.seed = seq_len, seed

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # inputs, targets [B, T]
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.seq_len - 1, size=batch_size)
        rows = np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]

    def sequential(self, batch_size: int, max_windows: int | None = None):
        """Non-overlapping windows in order (for evaluation)."""
        n = (self.tokens.size - 1) // self.seq_len
        if max_windows is not None:
            n = min(n, max_windows)
        for i in range(0, n, batch_size):
            idx = range(i, min(i + batch_size, n))
            rows = np.stack([self.tokens[j * self.seq_len : j * self.seq_len + self.seq_len + 1] for j in idx])
            t = torch.from_numpy(rows.astype(np.int64))
            yield t[:, :-1], t[:, 1:]
