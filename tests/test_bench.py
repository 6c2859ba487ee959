"""The task benchmark end to end on a tiny checkpoint: records, baselines, summary and plots."""

from __future__ import annotations

import json

import pytest

from verispec.bench.suite import BenchConfig, run

RECORD_KEYS = {"task", "method", "k", "tau", "acceptance_rate", "accepted_per_pos", "tokens_per_s",
               "speedup_vs_plain", "equal_to_plain", "num_diverged", "num_diverged_at_near_tie", "round_ms", "draft_ms",
               "decode_speedup_vs_plain", "plain_step_ms"}
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
        assert 0.0 < r["draft_ms"] < r["round_ms"]  # a round = drafting + the verifying target forward
        assert r["decode_speedup_vs_plain"] > 0.0 and r["plain_step_ms"] > 0.0
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


def test_serve_bench_output_schema(checkpoint_dir, tmp_path, monkeypatch):
    """`verispec bench serve` at toy scale: one closed-loop record per arm x client count and one open-loop record
    per arm x offered rate with the documented fields, the goals computed from them, and the summary and both
    plots written."""
    import json

    from verispec.bench.serve import ServeBenchConfig, run

    from verispec.bench import serve

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    ran: list[tuple[str, float, str]] = []  # (mode, load, arm) in the order the bench ran them
    for mode, name, arm_at, load_at in (("closed", "_closed_load", 1, 5), ("open", "_open_load", 0, 4)):
        def logged(*args, _real=getattr(serve, name), _mode=mode, _arm=arm_at, _load=load_at):
            ran.append((_mode, float(args[_load]), args[_arm].name))
            return _real(*args)

        monkeypatch.setattr(serve, name, logged)
    started: list = []  # every engine loop the bench starts: never two alive at once (each keeps an OpenMP pool)

    class OneAtATime(serve.AsyncEngine):
        def start(self):
            assert not any(a.alive for a in started), "an engine thread is still alive"
            started.append(self)
            return super().start()

    monkeypatch.setattr(serve, "AsyncEngine", OneAtATime)
    cfg = ServeBenchConfig(checkpoint_dir, drafters=("ngram",), long_k=3, concurrency=(1, 2), requests_per_client=1,
                           min_requests=2, max_tokens=6, max_prompt_tokens=40, dtype="fp32",
                           poisson_rates=(50.0, 100.0), poisson_duration_s=0.2, min_prompt_tokens=8, kv_pool=64)
    report = run(cfg, tmp_path / "out", progress=False)
    # Load by load, every arm in turn, the order rotated by one each load: arms compared at a load run together.
    arms = [a.name for a in cfg.arms()]
    loads = list(dict.fromkeys((m, x) for m, x, _ in ran))
    assert loads == [("closed", 1.0), ("closed", 2.0), ("open", 50.0), ("open", 100.0)]
    assert [(m, x) for m, x, _ in ran] == sorted(((m, x) for m, x, _ in ran), key=loads.index)
    for i, load in enumerate(loads[:3]):
        assert [a for m, x, a in ran if (m, x) == load] == arms[i:] + arms[:i]
    assert len(started) == 5 + len(ran) and not any(a.alive for a in started)  # warm-ups, then one per load
    names = {r["arm"] for r in report["results"]}
    assert names == {"off", "fixed-1/ngram", "fixed-3/ngram", "batch-table/ngram", "dspark/ngram"}
    assert len(report["results"]) == 5 * 2
    for arm in names:  # the second rate runs only where the first was sustained
        rates = [r for r in report["open_loop"] if r["arm"] == arm]
        assert [r["rate"] for r in rates] == ([50.0, 100.0] if rates[0]["sustained"] else [50.0])
    for r in report["results"] + report["open_loop"]:
        assert r["aggregate_tokens_per_s"] > 0 and r["per_user_tokens_per_s"] > 0
        assert set(r["ttft_s"]) == {"p50", "p90", "p99"} and r["requests"] >= 2
        assert r["pool"]["preemptions"] >= 0 and 0 < r["pool"]["kv_peak_use"] <= 1  # a 64-position pool
        # Every load starts its prompt list over: only an empty prefix cache keeps the previous load's (and the
        # warm-up's) blocks from hitting, unevenly across arms. Within one load these prompts share no prefix.
        assert r["pool"]["prefix_hit_rate"] == 0, (r["arm"], r.get("clients", r.get("rate")))
        # what the draft gate did over the load: only the dspark policy's steps can be kept plain
        assert 0 < r["pool"]["steps"] and 0 <= r["pool"]["undrafted_steps"] <= r["pool"]["steps"]
        assert r["arm"].startswith("dspark/") or r["pool"]["undrafted_steps"] == 0
    for r in report["open_loop"]:
        assert {"offered_rate", "completed_rate", "queue_slope", "sustained"} <= set(r) and r["failed"] == 0
    assert set(report["sustained"]) == names
    assert report["goals"][0]["goal"].startswith("dspark >= 1.6x per-user speed of fixed k=1 at every rate both")
    saved = json.loads((tmp_path / "out" / "serve_results.json").read_text())
    assert saved["results"] == report["results"]
    assert (tmp_path / "out" / "serve_pareto.png").stat().st_size > 0
    assert (tmp_path / "out" / "serve_openloop.png").stat().st_size > 0
    summary = (tmp_path / "out" / "serve_summary.md").read_text()
    assert "| arm |" in summary and "## Open loop" in summary and "highest sustained rate" in summary
    assert "KV pool peak" in summary and "steps kept plain by the draft gate" in summary


def test_serve_bench_repeats_the_open_loop_in_rotated_passes(checkpoint_dir, tmp_path, monkeypatch):
    """`--poisson-repeats 2`: the closed loop once, the open loop twice (every arm at every rate it reached, per
    pass), one combined record per arm and rate with both passes' speeds, and the summary saying so."""
    from verispec.bench.serve import ServeBenchConfig, run

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    cfg = ServeBenchConfig(checkpoint_dir, drafters=("ngram",), long_k=3, concurrency=(1,), requests_per_client=1,
                           min_requests=2, max_tokens=4, max_prompt_tokens=40, dtype="fp32", poisson_rates=(50.0,),
                           poisson_duration_s=0.2, min_prompt_tokens=8, kv_pool=64, poisson_repeats=2,
                           capacity_rate=80.0)
    report = run(cfg, tmp_path / "out", progress=False)
    assert len(report["results"]) == 5  # one closed-loop load per arm, in the first pass only
    assert sorted((r["arm"], r["repeat"]) for r in report["open_loop_passes"]) == sorted(
        (a, rep) for a in {r["arm"] for r in report["results"]} for rep in (0, 1))
    for r in report["open_loop"]:
        assert r["passes"] == 2 and len(r["per_user_by_pass"]) == 2 and None not in r["per_user_by_pass"]
        assert r["sustained"] == (r["sustained_passes"] == 2)
    summary = (tmp_path / "out" / "serve_summary.md").read_text()
    assert "2 passes, the arms' order rotated" in summary
    # the capacity rate: every arm in every pass, never skipped, kept apart from the rate grid's records
    assert list(report["capacity"]) == [r["arm"] for r in report["results"]]
    for c in report["capacity"].values():
        assert c["rate"] == 80.0 and c["passes"] == 2 and len(c["by_pass"]) == 2
    assert sorted((r["arm"], r["repeat"]) for r in report["capacity_passes"]) == sorted(
        (a, rep) for a in report["capacity"] for rep in (0, 1))  # the records, to re-derive capacities from
    assert all(r["rate"] == 50.0 for r in report["open_loop"])
    assert "## Capacity (every arm offered 80 req/s" in summary
    from verispec.errors import ConfigError

    with pytest.raises(ConfigError, match="poisson_repeats"):
        ServeBenchConfig(checkpoint_dir, poisson_repeats=0)
    with pytest.raises(ConfigError, match="capacity_rate"):
        ServeBenchConfig(checkpoint_dir, capacity_rate=0.0)
    with pytest.raises(ConfigError, match="give --poisson rates too"):
        ServeBenchConfig(checkpoint_dir, capacity_rate=5.0, poisson_rates=())


def test_serve_bench_runs_a_chosen_subset_of_arms(checkpoint_dir):
    """`--arms`: only the named arms run, in the bench's own order; a name it does not make is one clear error that
    lists the valid ones (the CLI prints it as one `error:` line, exit 2)."""
    from verispec.bench.serve import ServeBenchConfig
    from verispec.errors import ConfigError

    cfg = ServeBenchConfig(checkpoint_dir, drafters=("ngram",), long_k=3, only_arms=("dspark/ngram", "off"))
    assert [a.name for a in cfg.arms()] == ["off", "dspark/ngram"]
    assert len(ServeBenchConfig(checkpoint_dir, drafters=("ngram",)).arms()) == 5  # none named: all of them
    with pytest.raises(ConfigError, match=r"unknown serve-bench arms dspark/mtp .*choose from off, fixed-1/ngram"):
        ServeBenchConfig(checkpoint_dir, drafters=("ngram",), only_arms=("off", "dspark/mtp"))


def test_method_labels_tell_specs_of_one_drafter_apart():
    from verispec.bench.suite import method_labels

    got = method_labels(["ngram", "dspark:zoo/dspark", "dspark:zoo/dspark:full-vocab", "lookup:dspark:zoo/dspark"])
    assert got == {"ngram": "ngram", "dspark:zoo/dspark": "dspark (zoo/dspark)",
                   "dspark:zoo/dspark:full-vocab": "dspark (zoo/dspark:full-vocab)",
                   "lookup:dspark:zoo/dspark": "lookup:dspark"}


def test_block_goal_counts_block_drafters_per_output_token():
    """The block-drafter goal line: the best `block`/`dspark` record per code task (any policy, not a `lookup:`
    wrapper) against 2.5x per output token and the `model` drafter; end to end reported beside it."""
    from verispec.bench.report import block_goal_markdown

    def rec(task, spec, method, decode, e2e):
        return {"task": task, "spec": spec, "method": method, "k": 8, "decode_speedup_vs_plain": decode,
                "speedup_vs_plain": e2e}

    code = [rec("code_completion", "dspark:zoo/dspark", "dspark", 3.1, 2.1),
            rec("code_continuation", "dspark:zoo/dspark", "dspark", 2.4, 1.8),
            rec("code_continuation", "dspark:zoo/dspark", "dspark +dspark policy", 2.6, 1.9),
            rec("code_continuation", "lookup:dspark:zoo/dspark", "lookup:dspark", 2.9, 2.0),  # not a block drafter
            rec("code_completion", "model:zoo/drafter", "model", 1.3, 1.2)]
    (line,) = block_goal_markdown(code)
    assert "code_continuation 2.60x (dspark +dspark policy k=8)" in line and "2.90" not in line
    assert "end to end code_completion 2.10x, code_continuation 1.90x" in line
    assert "the `model` drafter code_completion 1.30x" in line and line.endswith(": met)")
    assert block_goal_markdown(code[:2])[0].endswith(": not met)")  # continuation 2.4x < 2.5x
    slower = code[:3] + [rec("code_completion", "model:zoo/drafter", "model", 3.5, 2.5)]
    assert block_goal_markdown(slower)[0].endswith(": not met)")  # the model drafter ahead on one task
    assert block_goal_markdown([code[4]]) == []  # no block drafter in the run: no line
