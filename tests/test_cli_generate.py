"""`verispec generate`: --compare times interleaved plain/speculative repeats and reports each one's equality with
plain decoding and the median speedups; the default drafter is the zoo's fastest, falling back gracefully."""

from __future__ import annotations

import json
import statistics

import pytest

from verispec.cli import _default_drafter, main
from verispec.zoo import best_drafter_spec

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


def _generate(target, *extra: str) -> list[str]:
    return ["generate", "--target", str(target), "--drafter", "ngram", "--k", "4", "--max-tokens", "12",
            "--ignore-eos", "--dtype", "fp32", "--threads", "1", "--prompt", PROMPT, "--compare", *extra]


def test_compare_json_reports_every_repeat_and_medians(checkpoint_dir, capsys):
    assert main(_generate(checkpoint_dir, "--repeats", "2", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    runs = out["repeats"]
    assert len(runs) == 2
    for r in runs:
        assert r["equal_to_plain"] is True
        assert r["speedup"] > 0 and r["decode_speedup"] > 0
        assert r["speedup"] == pytest.approx(r["tokens_per_s"] / r["plain_tokens_per_s"])
        assert r["decode_speedup"] == pytest.approx(r["decode_tokens_per_s"] / r["plain_decode_tokens_per_s"])
    assert out["equal_to_plain"] is True
    assert out["speedup"] == pytest.approx(statistics.median(r["speedup"] for r in runs))
    assert out["decode_speedup"] == pytest.approx(statistics.median(r["decode_speedup"] for r in runs))
    assert out["plain_tokens_per_s"] == pytest.approx(statistics.median(r["plain_tokens_per_s"] for r in runs))
    assert "prefill included" in out["speedup_basis"]
    # What a single-run --compare printed is still there.
    assert {"text", "token_ids", "finish_reason", "stats"} <= set(out)
    assert len(out["token_ids"]) == 12 and out["drafter"] == "ngram"


def test_compare_text_shows_drafter_prompt_continuation_and_repeats(checkpoint_dir, capsys):
    assert main(_generate(checkpoint_dir, "--repeats", "2")) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(PROMPT) and len(captured.out) > len(PROMPT)  # the prompt, then the continuation
    err = captured.err
    assert "drafter ngram, k 4" in err
    assert "--- prompt (" in err and "--- continuation (speculative) ---" in err
    assert "repeat 1:" in err and "repeat 2:" in err and "repeat 3:" not in err
    assert err.count("equal_to_plain True") == 3  # each repeat and the summary
    assert "median of 2 interleaved repeats" in err
    assert "end to end (prompt prefill included)" in err and "per output token (after the prefill)" in err


def test_compare_refuses_zero_repeats(checkpoint_dir, capsys):
    assert main(_generate(checkpoint_dir, "--repeats", "0")) == 2
    assert capsys.readouterr().err.strip() == "error: --repeats must be at least 1 (got 0)"


def test_best_drafter_falls_back_to_prompt_lookup(tmp_path):
    """lookup:dspark over the zoo's DSpark drafter where it ships one, else ngram (the draft model is slower than
    prompt lookup in reports/bench, so it is never the fallback)."""
    assert best_drafter_spec(tmp_path) == "ngram"
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{}")
    assert best_drafter_spec(tmp_path) == "ngram"
    (tmp_path / "dspark").mkdir()
    (tmp_path / "dspark" / "config.json").write_text("{}")
    assert best_drafter_spec(tmp_path) == f"lookup:dspark:{tmp_path / 'dspark'}"


def test_default_drafter_is_the_zoos_only_for_the_zoos_target(tmp_path, monkeypatch, checkpoint_dir):
    zoo = tmp_path / "zoo"
    (zoo / "dspark").mkdir(parents=True)
    (zoo / "dspark" / "config.json").write_text("{}")
    monkeypatch.setenv("VERISPEC_ZOO", str(zoo))
    assert _default_drafter(zoo / "target") == f"lookup:dspark:{zoo / 'dspark'}"
    assert _default_drafter(checkpoint_dir) == "ngram"  # another target: the zoo's drafters may not fit it
