"""The shipped long-context prompt set (bench/prompts.py build_long_context): 8 windows per ~1,000 / ~1,500 /
~1,900-token bucket of the zoo tokenizer, from bench-split stdlib code, each leaving room for 192 new tokens in
the target's 2,048-token context; and a deterministic builder."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from verispec.bench.prompts import LONG_TASKS, PROMPT_DIR, TASKS, build_long_context, load_task
from verispec.errors import VerispecError
from verispec.model.tokenizer import Tokenizer
from verispec.train.corpus import Document, split_of
from verispec.zoo import zoo_dir

STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILE = PROMPT_DIR / "long_context.jsonl"
CONTEXT, NEW_TOKENS = 2048, 192


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(zoo_dir() / "target")


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return [json.loads(line) for line in FILE.read_text().splitlines() if line.strip()]


def test_24_records_from_the_bench_split_within_5_percent_of_their_bucket(records, tokenizer):
    assert len(records) == 24
    assert len({r["id"] for r in records}) == 24
    assert sorted(r["length_bucket"] for r in records) == [1000] * 8 + [1500] * 8 + [1900] * 8
    for r in records:
        assert r["task"] == "long_context"
        assert r["source"]["part"] == "code"
        assert split_of(r["source"]["part"], r["source"]["path"]) == "bench", r["id"]
        n = len(tokenizer.encode(r["prompt"]))
        assert n == r["num_tokens"], r["id"]
        assert abs(n - r["length_bucket"]) <= 0.05 * r["length_bucket"], r["id"]
        assert n < CONTEXT - 200 and n + NEW_TOKENS <= CONTEXT, r["id"]


def test_windows_end_at_a_line_and_the_reference_is_the_files_next_text(records):
    for r in records:
        source = (STDLIB / r["source"]["path"]).read_text(encoding="utf-8", errors="replace")
        at = source.find(r["prompt"] + r["reference"])
        assert at >= 0, r["id"]
        assert at == 0 or source[at - 1] == "\n", r["id"]
        assert r["prompt"].endswith("\n") and r["reference"].strip(), r["id"]
    assert len({r["source"]["path"] for r in records}) == 24  # the split has enough long files: one window each


def test_kept_out_of_the_default_tasks_but_loadable_by_name():
    assert "long_context" in LONG_TASKS and "long_context" not in TASKS
    loaded = load_task("long_context")
    assert len(loaded) == 24 and {r["length_bucket"] for r in loaded} == {1000, 1500, 1900}
    assert all(isinstance(r["num_tokens"], int) for r in loaded)
    assert "length_bucket" not in load_task("code_continuation")[0]
    with pytest.raises(VerispecError, match="unknown prompt set"):
        load_task("long")


def test_builder_is_deterministic(tmp_path, records, tokenizer):
    """One window per bucket from the shipped files plus a training-split file (which must be dropped), twice."""
    paths = sorted({r["source"]["path"] for r in records})[:8] + ["os.py"]
    assert split_of("code", "os.py") != "bench"
    docs = [Document("code", p, (STDLIB / p).read_text(encoding="utf-8", errors="replace")) for p in paths]
    outs = []
    for name in ("a.jsonl", "b.jsonl"):
        counts = build_long_context(tmp_path / name, per_length=1, seed=0, tokenizer=tokenizer, docs=docs,
                                    check_training=False)
        outs.append((tmp_path / name).read_text())
        assert {k: len(v) for k, v in counts.items()} == {1000: 1, 1500: 1, 1900: 1}
    assert outs[0] == outs[1]
    built = [json.loads(line) for line in outs[0].splitlines()]
    assert [r["length_bucket"] for r in built] == [1000, 1500, 1900]
    assert all(r["source"]["path"] in paths[:-1] for r in built)
    assert len({r["source"]["path"] for r in built}) == 3
    other = build_long_context(tmp_path / "c.jsonl", per_length=1, seed=1, tokenizer=tokenizer, docs=docs,
                               check_training=False)
    assert other  # another seed builds too (a different draw, not checked for difference: few files here)


def test_no_window_or_reference_occurs_in_a_training_file(records):
    train_text = "\n".join((STDLIB / p).read_text(encoding="utf-8", errors="replace")
                           for p in (f.relative_to(STDLIB).as_posix() for f in sorted(STDLIB.rglob("*.py")))
                           if not p.startswith(("site-packages/", "dist-packages/")) and split_of("code", p) == "train")
    train_bytes = train_text.encode()  # bytes search: ~15x faster than str search here
    for r in records:
        assert r["prompt"].encode() not in train_bytes and r["reference"].encode() not in train_bytes, r["id"]
