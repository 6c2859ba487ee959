"""The task benchmark end to end on a tiny checkpoint: records, baselines, summary and plots."""

from __future__ import annotations

import json

from verispec.bench.suite import BenchConfig, run

RECORD_KEYS = {"task", "method", "k", "tau", "acceptance_rate", "accepted_per_pos", "tokens_per_s",
               "speedup_vs_plain", "equal_to_plain", "num_diverged", "num_diverged_at_near_tie"}
BASELINE_KEYS = {"system", "task", "tokens_per_s", "verispec_ratio", "equal_tokens_fp32"}


def test_bench_output_schema(checkpoint_dir, tmp_path):
    cfg = BenchConfig.quick(
        checkpoint_dir, methods=("ngram", f"model:{checkpoint_dir}"), ks=(2, 3), prompts_per_task=1,
        max_tokens=8, dtype="fp32", baseline_prompts=1,
    )
    out = tmp_path / "out"
    run(cfg, out, progress=False)
    report = json.loads((out / "results.json").read_text())
    records = report["records"]
    assert {(r["task"], r["method"], r["k"]) for r in records} == {
        (t, m, k) for t in cfg.tasks for m in ("ngram", "model") for k in (2, 3)
    }
    for r in records:
        assert RECORD_KEYS <= set(r)
        assert r["equal_to_plain"] and r["num_diverged"] == 0  # fp32 greedy is exact
        assert 1.0 <= r["tau"] <= r["k"] + 1 and len(r["accepted_per_pos"]) <= r["k"]
        if r["method"] == "model":  # the target drafting for itself accepts everything
            assert r["acceptance_rate"] == 1.0
    systems = {b["system"] for b in report["baselines"] if "tokens_per_s" in b}
    assert systems == {"hf_generate", "hf_prompt_lookup", "hf_assisted_default", "hf_assisted_const_k"}
    for b in report["baselines"]:
        if "tokens_per_s" in b:
            assert BASELINE_KEYS <= set(b) and b["equal_tokens_fp32"] is True
    for name in ("summary.md", "speedup.png", "acceptance.png"):
        assert (out / name).stat().st_size > 0
    assert "| code_completion | ngram | 2 |" in (out / "summary.md").read_text()
