"""The shipped benchmark prompt sets: size, provenance in the held-out split, and no overlap with training."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from verispec.bench.prompts import PROMPT_DIR, TASKS, load_prompts
from verispec.errors import VerispecError
from verispec.train.corpus import split_of, stdlib_documents

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _records(task: str) -> list[dict]:
    return [json.loads(line) for line in (PROMPT_DIR / f"{task}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("task", TASKS)
def test_at_least_40_prompts_from_the_bench_split(task):
    records = _records(task)
    assert len(records) >= 40
    assert len({r["id"] for r in records}) == len(records)
    for r in records:
        assert split_of(r["source"]["part"], r["source"]["path"]) == "bench", r["id"]


def test_code_prompts_come_from_their_file_and_not_from_training_files():
    """Each code prompt's text is in its (held-out) source file and in no training-split stdlib file."""
    train_text = "\n".join(d.text for d in stdlib_documents() if split_of("code", d.path) == "train")
    for task in ("code_completion", "code_continuation", "editing"):
        for r in _records(task):
            source = (STDLIB / r["source"]["path"]).read_text(encoding="utf-8", errors="replace")
            body = r["prompt"]
            if task == "editing":  # the function between the wrapper lines
                body = body.split("\n", 1)[1].rsplit("\n# The same function", 1)[0].rstrip("\n")
            assert body in source, r["id"]
            assert body not in train_text, f"{r['id']} also appears in the training split"
            assert r["reference"] not in train_text, f"{r['id']}'s reference appears in the training split"


def test_load_user_prompt_files(tmp_path):
    """Plain JSONL prompts and Spec-Bench question.jsonl both load; bad files fail with a clear error."""
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "def f():"}\n\n{"prompt": "import os", "id": "b"}\n')
    assert [r["prompt"] for r in load_prompts(plain)] == ["def f():", "import os"]
    spec = tmp_path / "question.jsonl"
    spec.write_text('{"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Again."]}\n')
    assert load_prompts(spec) == [{"id": "81", "task": "writing", "prompt": "Write a haiku."}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(VerispecError, match="bad.jsonl:1"):
        load_prompts(bad)
    with pytest.raises(VerispecError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")
