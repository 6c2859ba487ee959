"""The benchmark's Markdown summary and PNG plots, from results.json's content."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def _fmt(x: float) -> str:
    return f"{x:.2f}"


def _round_ms(r: dict) -> str:
    return f"{r['round_ms']:.1f} ({r['draft_ms']:.1f})" if "round_ms" in r else "-"  # older results.json lack it


def _optional(r: dict, key: str, fmt: str) -> str:
    return fmt.format(r[key]) if key in r else "-"  # older results.json lack the prefill split


def _best_per_task(records: list[dict], key: str) -> dict[str, tuple[float, str]]:
    """{task: (the largest `key`, its method label)} over the records that have `key`."""
    best: dict[str, tuple[float, str]] = {}
    for r in records:
        if key in r and r[key] > best.get(r["task"], (0.0, ""))[0]:
            best[r["task"]] = (r[key], f"{r['method']} k={r['k']}")
    return best


def _best(records: list[dict], key: str) -> str:
    return ", ".join(f"{t} {_fmt(s)}x ({m})" for t, (s, m) in _best_per_task(records, key).items())


def summary_markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"# verispec bench: {Path(cfg['target']).name}, {cfg['dtype']}, {report['threads']} threads, greedy, "
        f"{cfg['max_tokens']} new tokens, {cfg['repeats']} repeat(s)",
        "",
        "Speedup: median over repeats of plain time / method time on the same prompts, interleaved, end to end "
        "(prompt prefill included). Decode speedup: the same without each prompt's prefill, which is identical "
        "work with or without a drafter (the ratio of time per output token). ms/round: a speculative round's time "
        "after the prefill (first repeat), with the drafter's share in brackets; the rest is the target forward "
        "that verifies k + 1 positions; plain ms/step is a plain decoding step after the prefill.",
        "",
        "| task | method | k | tau | acceptance | tokens/s | plain tokens/s | ms/round (draft) | plain ms/step "
        "| speedup | decode speedup | equal to plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["records"]:
        eq = "yes" if r["equal_to_plain"] else (
            f"{r['num_diverged']}/{r['num_prompts']} diverged ({r['num_diverged_at_near_tie']} at a near-tie)")
        lines.append(f"| {r['task']} | {r['method']} | {r['k']} | {_fmt(r['tau'])} | {_fmt(r['acceptance_rate'])} | "
                     f"{r['tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | {_round_ms(r)} | "
                     f"{_optional(r, 'plain_step_ms', '{:.1f}')} | **{_fmt(r['speedup_vs_plain'])}x** | "
                     f"{_optional(r, 'decode_speedup_vs_plain', '{:.2f}x')} | {eq} |")
    lines += ["", "Best per task: " + _best(report["records"], "speedup_vs_plain")]
    if all("decode_speedup_vs_plain" in r for r in report["records"]):
        lines.append("Best decode speedup per task: " + _best(report["records"], "decode_speedup_vs_plain"))
    lines.append("")
    baselines = [b for b in report["baselines"] if "tokens_per_s" in b]
    lines += goals_markdown(report["records"], baselines)
    if baselines:
        lines += ["## Baselines (Hugging Face transformers, same weights and dtype)", "",
                  "| system | task | tokens/s | verispec method | verispec tokens/s | verispec ratio | fp32 tokens equal |",
                  "|---|---|---|---|---|---|---|"]
        for b in baselines:
            lines.append(f"| {b['system']} | {b['task']} | {b['tokens_per_s']:.1f} | {b['verispec_method']} | "
                         f"{b['verispec_tokens_per_s']:.1f} | **{_fmt(b['verispec_ratio'])}x** | {b['equal_tokens_fp32']} |")
        lines.append("")
    if "llamacpp" in report:
        lines += llamacpp_markdown(report)
    return "\n".join(lines)


def _tps(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def llamacpp_markdown(report: dict) -> list[str]:
    """verispec's arms and llama.cpp's side by side per task, the issue's two speed goals and the fp32 check."""
    cfg, lc, records = report["config"], report["llamacpp"], report["records"]
    plain_arms = [r["arm"] for r in lc["records"] if r["kind"] == "plain"]
    ref_arm = "plain-bf16" if "plain-bf16" in plain_arms else next(iter(plain_arms), "plain-bf16")
    ref_quant = ref_arm.split("-", 1)[1]
    lines = ["## Side by side with llama.cpp", "",
             f"The same weights converted to GGUF, the same prompt token ids, greedy, {report['threads']} threads, "
             f"{cfg['max_tokens']} new tokens; llama.cpp's arms run right after verispec's on each prompt. "
             "Tokens/s: generated tokens over the summed time of the task's prompts (median over repeats), end to "
             "end (prefill included) and after the prefill (per output token). llama.cpp's speculative arms are its "
             "own `llama-speculative` (draft model) and `llama-lookup` (prompt lookup) binaries, timed by their "
             "own counters; their `equal to plain` compares the text with plain decoding of the same GGUF. llama.cpp "
             "runs at its CPU defaults: flash attention on, K and V cached in f16.", "",
             f"| task | system | method | tokens/s | tokens/s after prefill | x llama.cpp plain {ref_quant} "
             "(after prefill) | acceptance | equal to plain |", "|---|---|---|---|---|---|---|---|"]
    for task in dict.fromkeys(r["task"] for r in lc["records"]):
        ref = next((r["decode_tokens_per_s"] for r in lc["records"] if r["task"] == task and r["arm"] == ref_arm),
                   None)

        def ratio(x: float | None) -> str:
            return f"{x / ref:.2f}x" if ref and x else "-"

        ours = [r for r in records if r["task"] == task and "decode_tokens_per_s" in r]
        if ours:
            p = ours[0]
            lines.append(f"| {task} | verispec | plain {cfg['dtype']} | {_tps(p['plain_tokens_per_s'])} | "
                         f"{_tps(p['plain_decode_tokens_per_s'])} | {ratio(p['plain_decode_tokens_per_s'])} | - | - |")
        for r in ours:
            eq = "yes" if r["equal_to_plain"] else f"{r['num_prompts'] - r['num_diverged']}/{r['num_prompts']}"
            lines.append(f"| {task} | verispec | {r['method']} k={r['k']} {cfg['dtype']} | {_tps(r['tokens_per_s'])} | "
                         f"{_tps(r['decode_tokens_per_s'])} | {ratio(r['decode_tokens_per_s'])} | "
                         f"{_fmt(r['acceptance_rate'])} | {eq} |")
        for r in (r for r in lc["records"] if r["task"] == task):
            acc = "-" if r["acceptance_rate"] is None else _fmt(r["acceptance_rate"])
            eq = "-" if r["equal_to_plain"] is None else f"{r['equal_to_plain']}/{r['num_prompts']}"
            method = f"{r['kind']} {r['quant']}" + (f" draft {r['draft']}" if r["draft"] else "")
            lines.append(f"| {task} | llama.cpp | {method} | {_tps(r['tokens_per_s'])} | "
                         f"{_tps(r['decode_tokens_per_s'])} | {ratio(r['decode_tokens_per_s'])} | {acc} | {eq} |")
    lines += [""] + llamacpp_goals(records, lc["records"], cfg["dtype"])
    eq = lc["fp32_equality"]
    line = (f"fp32 token equality (llama.cpp's f32 GGUF through the binding with an f32 KV cache and no flash "
            f"attention vs verispec fp32, plain greedy, {eq['max_tokens']} tokens): "
            f"{eq['num_equal']}/{eq['num_prompts']} prompts equal")
    if eq["differences"]:
        d = eq["differences"][0]
        line += (f"; first difference: {d['task']} prompt {d['prompt']} at token {d['position']} (verispec "
                 f"{d['verispec']}, llama.cpp {d['llama.cpp']}, verispec's top-2 log-prob gap {d['top2_gap']:.3f})")
    mismatched = sum(r["num_prompts"] - r["prompt_ids_equal"] for r in lc["records"] if r["kind"] != "plain")
    if mismatched:
        line += f"; {mismatched} prompt(s) tokenized differently by llama.cpp's binaries"
    return lines + [line, ""]


def llamacpp_goals(records: list[dict], lc: list[dict], dtype: str) -> list[str]:
    """Issue 18's goals on the code tasks: verispec plain >= 0.8x llama.cpp bf16 plain per output token, and
    verispec's best drafter >= 1.3x llama.cpp's best bf16 mode (plain, speculative or lookup) end to end."""
    code = sorted({r["task"] for r in lc if r["task"].startswith("code")})
    plain, best, ours_plain, ours_best = {}, {}, {}, {}
    for t in code:
        bf16 = [r for r in lc if r["task"] == t and r["quant"] == "bf16"]
        plain[t] = next((r["decode_tokens_per_s"] for r in bf16 if r["kind"] == "plain"), None)
        best[t] = max((r["tokens_per_s"] for r in bf16), default=None)
        ours = [r for r in records if r["task"] == t and "decode_tokens_per_s" in r]
        ours_plain[t] = ours[0]["plain_decode_tokens_per_s"] if ours else None
        ours_best[t] = max((r["tokens_per_s"] for r in ours), default=None)
    lines = []
    pairs = [(t, ours_plain[t] / plain[t]) for t in code if ours_plain[t] and plain[t]]
    if pairs and dtype == "bf16":
        worst = min(v for _, v in pairs)
        lines.append("- verispec plain vs llama.cpp bf16 plain per output token: " + ", ".join(
            f"{t} {_fmt(v)}x" for t, v in pairs) + f" (goal >= 0.8x on each: {'met' if worst >= 0.8 else 'not met'})")
    pairs = [(t, ours_best[t] / best[t]) for t in code if ours_best[t] and best[t]]
    if pairs and dtype == "bf16":
        worst = min(v for _, v in pairs)
        lines.append("- verispec's best drafter vs llama.cpp's best bf16 mode end to end: " + ", ".join(
            f"{t} {_fmt(v)}x" for t, v in pairs) + f" (goal >= 1.3x on each: {'met' if worst >= 1.3 else 'not met'})")
    return lines + [""] if lines else []


def _geomean(xs: list[float]) -> float:
    import math

    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def goals_markdown(records: list[dict], baselines: list[dict]) -> list[str]:
    """The zoo issue's three goals (geometric means over tasks) and the block-drafter issue's, as measured."""
    lines = ["## Goals (as measured)", ""]
    gen = [b["verispec_ratio"] for b in baselines if b["system"] == "hf_generate"]
    if gen:
        g = _geomean(gen)
        lines.append(f"- verispec plain decoding vs HF `generate`: {_fmt(g)}x (goal >= 1.5x: {'met' if g >= 1.5 else 'not met'})")
    code = [r for r in records if r["task"].startswith("code")]
    if code:
        per_task = defaultdict(float)
        for r in code:
            per_task[r["task"]] = max(per_task[r["task"]], r["speedup_vs_plain"])
        worst = min(per_task.values())
        lines.append("- best drafter vs plain on the code tasks: " + ", ".join(
            f"{t} {_fmt(v)}x" for t, v in per_task.items()) + f" (goal >= 2.0x on each: {'met' if worst >= 2 else 'not met'})")
    lines += block_goal_markdown(code)
    assisted = [b for b in baselines if b["system"].startswith("hf_assisted")]
    for system in dict.fromkeys(b["system"] for b in assisted):
        g = _geomean([b["verispec_ratio"] for b in assisted if b["system"] == system])
        lines.append(f"- verispec `model` drafter vs HF {system}: {_fmt(g)}x (goal >= 2x: {'met' if g >= 2 else 'not met'})")
    return lines + [""]


BLOCK_DRAFTERS = ("block", "dspark")  # the block drafters' registry names (drafters/block.py)


def block_goal_markdown(code: list[dict]) -> list[str]:
    """The block-drafter issue's goal on the code tasks' records: the best block drafter (any policy; a `lookup:`
    wrapper does not count) >= 2.5x plain per output token, above the `model` drafter. End to end alongside: the
    prompt's prefill, the same work for every method, stays in both times there."""
    def best(drafters: tuple[str, ...], key: str) -> dict[str, tuple[float, str]]:
        return _best_per_task([r for r in code if r["spec"].split(":")[0] in drafters], key)

    decode, e2e = best(BLOCK_DRAFTERS, "decode_speedup_vs_plain"), best(BLOCK_DRAFTERS, "speedup_vs_plain")
    if not decode:
        return []
    model = best(("model",), "decode_speedup_vs_plain")
    met = min(v for v, _ in decode.values()) >= 2.5 and all(v > model[t][0] for t, (v, _) in decode.items()
                                                              if t in model)
    line = "- best block drafter vs plain on the code tasks, per output token: " + ", ".join(
        f"{t} {_fmt(v)}x ({m})" for t, (v, m) in decode.items())
    line += "; end to end " + ", ".join(f"{t} {_fmt(v)}x" for t, (v, _) in e2e.items())
    line += ("; the `model` drafter " + ", ".join(f"{t} {_fmt(v)}x" for t, (v, _) in model.items()) if model
             else "; the `model` drafter not in this run")
    return [line + f" (goal >= 2.5x per output token on each, above the `model` drafter: {'met' if met else 'not met'})"]


def plot(report: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = report["records"]
    tasks = list(dict.fromkeys(r["task"] for r in records))
    methods = list(dict.fromkeys((r["method"], r["k"]) for r in records))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(tasks) + 2), 4))
    width = 0.8 / max(1, len(methods))
    for i, (m, k) in enumerate(methods):
        ys = [next((r["speedup_vs_plain"] for r in records if r["task"] == t and (r["method"], r["k"]) == (m, k)), 0)
              for t in tasks]
        ax.bar([j + i * width for j in range(len(tasks))], ys, width, label=f"{m} k={k}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks, rotation=15)
    ax.set_ylabel("speedup over plain decoding")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3.2), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], tasks):
        for r in records:
            if r["task"] == t and r["accepted_per_pos"]:
                ax.plot(range(1, len(r["accepted_per_pos"]) + 1), r["accepted_per_pos"], "o-", ms=3,
                        label=f"{r['method']} k={r['k']}")
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("draft position j")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("P(j accepted | all before)")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=110)
    plt.close(fig)


def write_report(report: dict, out: Path) -> None:
    (out / "summary.md").write_text(summary_markdown(report))
    plot(report, out)
