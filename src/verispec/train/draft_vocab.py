"""A frequency-ranked draft vocabulary for a block drafter (FR-Spec, Zhao et al. 2025: SGLang's truncated-vocab
LM head, `--speculative-token-map`, peers.md).

A block drafter's costliest ops per round are over the vocabulary: the shared LM head on every block position
and the Markov head's transition bias. Restricting both to the most frequent tokens of the training text cuts
them in proportion; the drafter can then never propose the other tokens, which costs acceptance only where the
target would have emitted one of them. The drafter's q is zero outside the set, so verification is unchanged.

Frequencies come from the training split only (never the benchmark's files): a built corpus's `train.jsonl`, or
the standard library's code split by `corpus.split_of` when no corpus was built.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from verispec.drafters.block import VOCAB_FILE
from verispec.model.tokenizer import Tokenizer
from verispec.train.corpus import Document, read_split, split_of, stdlib_documents


def training_documents(corpus: Path | None) -> tuple[Iterable[Document], str]:
    """The training split's documents and a line saying where they come from."""
    if corpus is not None:
        return read_split(corpus, "train"), f"{corpus}/train.jsonl"
    docs = (d for d in stdlib_documents() if split_of(d.part, d.path) == "train")
    return docs, "the Python standard library's train split (code only: no corpus given)"


def token_counts(tokenizer: Tokenizer, documents: Iterable[Document]) -> np.ndarray:  # [V] int64
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    for doc in documents:
        ids = tokenizer.encode(doc.text)
        if ids:
            counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=tokenizer.vocab_size)
    return counts


def top_tokens(counts: np.ndarray, size: int, always: Iterable[int] = ()) -> list[int]:
    """`always`, then the most frequent other token ids (ties to the lower id) up to `size`, ascending."""
    keep = {int(t) for t in always}
    if not max(1, len(keep)) <= size <= len(counts):
        raise ValueError(f"draft vocabulary size must be in [{max(1, len(keep))}, {len(counts)}], got {size}")
    order = [t for t in np.argsort(-counts, kind="stable").tolist() if t not in keep]
    return sorted(keep | set(order[: size - len(keep)]))


def write_draft_vocab(drafter_dir: Path, tokenizer: Tokenizer, size: int, corpus: Path | None = None) -> dict:
    """Rank the training text's tokens and write drafter_dir/draft_vocab.json; returns what it wrote."""
    documents, source = training_documents(corpus)
    counts = token_counts(tokenizer, documents)
    ids = top_tokens(counts, size, always=tokenizer.eos_token_ids)  # the drafter can always propose the end
    total = int(counts.sum())
    meta = {
        "size": len(ids),
        "source": source,
        "training_tokens": total,
        "coverage": float(counts[ids].sum() / total) if total else 0.0,  # of the training text's tokens
        "token_ids": ids,
    }
    (drafter_dir / VOCAB_FILE).write_text(json.dumps(meta) + "\n")
    return meta
