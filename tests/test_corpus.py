"""The corpus recipe: deterministic split by file, nothing in two splits, documents round-trip."""

from __future__ import annotations

import json

from verispec.train.corpus import SPLITS, build_corpus, read_split, split_of
from verispec.train.data import TokenWindows, tokenize_split
from verispec.train.tokenizer import SPECIAL_TOKENS, save_tokenizer, train_bpe
from verispec.model.tokenizer import Tokenizer


def _fake_sources(tmp_path):
    stdlib = tmp_path / "stdlib"
    docs = tmp_path / "docs"
    for i in range(60):
        (stdlib / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (stdlib / f"pkg{i % 3}" / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
        (docs / "library").mkdir(parents=True, exist_ok=True)
        (docs / "library" / f"page{i}.rst.txt").write_text(f"Page {i}\n=======\n\nText number {i}.\n")
    (stdlib / "site-packages").mkdir()
    (stdlib / "site-packages" / "third_party.py").write_text("x = 1\n")
    return stdlib, docs


def test_split_is_deterministic_and_by_file(tmp_path):
    """The same sources give byte-identical splits; each file lands in exactly one split; site-packages is out."""
    stdlib, docs = _fake_sources(tmp_path)
    a = build_corpus(tmp_path / "a", doc_dir=docs, stdlib_dir=stdlib)
    b = build_corpus(tmp_path / "b", doc_dir=docs, stdlib_dir=stdlib)
    assert a == b
    for s in SPLITS:
        assert (tmp_path / "a" / f"{s}.jsonl").read_bytes() == (tmp_path / "b" / f"{s}.jsonl").read_bytes()
    seen = {}
    for s in SPLITS:
        for doc in read_split(tmp_path / "a", s):
            key = (doc.part, doc.path)
            assert key not in seen, f"{key} in {seen.get(key)} and {s}"
            seen[key] = s
            assert split_of(doc.part, doc.path) == s
    assert len(seen) == 120
    assert not any("site-packages" in path for _, path in seen)
    counts = json.loads((tmp_path / "a" / "manifest.json").read_text())["counts"]
    assert sum(c["code"]["files"] + c["prose"]["files"] for c in counts.values()) == 120


def test_bench_text_never_in_train(tmp_path):
    """No benchmark-split document text appears inside the training split."""
    stdlib, docs = _fake_sources(tmp_path)
    build_corpus(tmp_path / "c", doc_dir=docs, stdlib_dir=stdlib)
    train = "\n".join(d.text for d in read_split(tmp_path / "c", "train"))
    bench = [d.text for d in read_split(tmp_path / "c", "bench")]
    assert bench, "the fake corpus should put some files in the bench split"
    assert not any(text in train for text in bench)


def test_tokenizer_specials_and_token_files(tmp_path):
    """The BPE has bos/eos/pad/mask at ids 0-3, round-trips text, and token files frame documents."""
    stdlib, docs = _fake_sources(tmp_path)
    build_corpus(tmp_path / "c", doc_dir=docs, stdlib_dir=stdlib)
    tok = train_bpe((d.text for d in read_split(tmp_path / "c", "train")), 300)
    save_tokenizer(tok, tmp_path / "tok")
    tok = Tokenizer.from_dir(tmp_path / "tok")
    assert [tok._tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.eos_token_ids == (1,) and tok.bos_token_id == 0
    text = "def f(x):\n    return x + 42  # ünïcode\n"
    assert tok.decode(tok.encode(text)) == text
    n = tokenize_split(tmp_path / "c", "train", tok, tmp_path / "train.bin")
    windows = TokenWindows(tmp_path / "train.bin", seq_len=16, seed=3)
    assert windows.tokens.size == n and int(windows.tokens[0]) == 0
    x1, y1 = windows.batch(5, 4)
    x2, y2 = windows.batch(5, 4)
    assert (x1 == x2).all() and (x1[:, 1:] == y1[:, :-1]).all()
