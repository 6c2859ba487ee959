"""Data preparation shared by the training recipes: corpus -> tokenizer -> token files, each step skipped
when its output already exists."""

from __future__ import annotations

import json
from pathlib import Path

from verispec.model.tokenizer import Tokenizer
from verispec.train.corpus import SPLITS, build_corpus, read_split
from verispec.train.data import tokenize_split
from verispec.train.tokenizer import save_tokenizer, train_bpe

VOCAB_SIZE = 8192


def prepare_data(data_dir: Path, doc_dir: Path | None = None, log=print) -> Tokenizer:
    """data_dir/corpus/*.jsonl, data_dir/tokenizer/, data_dir/tokens/{split}.bin."""
    corpus = data_dir / "corpus"
    if not (corpus / "manifest.json").is_file():
        log(f"building the corpus in {corpus}")
        manifest = build_corpus(corpus, doc_dir)
        log(json.dumps(manifest["counts"]))
    tok_dir = data_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        log(f"training a {VOCAB_SIZE}-token byte-level BPE on the train split")
        save_tokenizer(train_bpe((d.text for d in read_split(corpus, "train")), VOCAB_SIZE), tok_dir)
    tokenizer = Tokenizer.from_dir(tok_dir)
    for split in SPLITS:
        out = data_dir / "tokens" / f"{split}.bin"
        if not out.is_file():
            n = tokenize_split(corpus, split, tokenizer, out)
            log(f"tokenized {split}: {n} tokens")
    return tokenizer
