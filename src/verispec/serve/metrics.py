"""Prometheus text exposition of the engine's counters and gauges.

Names follow vLLM's (`vllm:spec_decode_num_drafts` ...) under the `verispec:` prefix, so dashboards built for
vLLM carry over by swapping the prefix.
"""

from __future__ import annotations

from verispec.engine.engine import Engine

PREFIX = "verispec:"


def _line(name: str, kind: str, help_: str, samples: list[tuple[dict[str, str], float]]) -> list[str]:
    out = [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} {kind}"]
    metric = f"{PREFIX}{name}_total" if kind == "counter" else f"{PREFIX}{name}"
    for labels, value in samples:
        lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
        out.append(f"{metric}{{{lab}}} {value}" if lab else f"{metric} {value}")
    return out


def render_metrics(engine: Engine) -> str:
    m = engine.metrics
    budget = engine.config.cache_budget_tokens
    lines: list[str] = []
    lines += _line("num_requests_running", "gauge", "Requests being decoded.", [({}, len(engine.running))])
    lines += _line("num_requests_waiting", "gauge", "Requests waiting for admission.", [({}, engine.num_waiting)])
    lines += _line("kv_cache_usage_perc", "gauge", "Fraction of the KV pool held by running requests' caches.",
                   [({}, engine.reserved_tokens / budget)])
    lines += _line("num_preemptions", "counter", "Running requests preempted because the KV pool ran short.",
                   [({}, m.preemptions)])
    lines += _line("recomputed_tokens", "counter", "Committed tokens prefilled again after preemptions.",
                   [({}, m.recomputed_tokens)])
    lines += _line("prompt_tokens", "counter", "Prompt tokens of admitted requests.", [({}, m.prompt_tokens)])
    lines += _line("generation_tokens", "counter", "Generated tokens.", [({}, m.generation_tokens)])
    lines += _line("request_success", "counter", "Finished requests by finish reason.",
                   [({"finished_reason": r}, n) for r, n in sorted(m.finished.items())] or [({"finished_reason": "stop"}, 0)])
    lines += _line("num_requests_rejected", "counter", "Requests refused because the queue was full.",
                   [({}, m.rejected)])
    lines += _line("engine_steps", "counter", "Engine steps (one target forward each).", [({}, m.num_steps)])
    prefix = engine.prefix
    lines += _line("prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
                   [({}, prefix.queried_tokens if prefix else 0)])
    lines += _line("prefix_cache_hits", "counter", "Prompt tokens whose KV rows came from the prefix cache.",
                   [({}, prefix.hit_tokens if prefix else 0)])
    lines += _line("engine_undrafted_steps", "counter",
                   "Steps whose dspark-policy requests drafted nothing because drafting did not pay at that load.",
                   [({}, m.undrafted_steps)])
    lines += _line("spec_decode_num_drafts", "counter", "Verification rounds with at least one draft token.",
                   [({}, m.num_drafts)])
    lines += _line("spec_decode_num_draft_tokens", "counter", "Draft tokens verified.", [({}, m.num_draft_tokens)])
    lines += _line("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
                   [({}, m.num_accepted_tokens)])
    lines += _line("spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted draft tokens per position.",
                   [({"position": str(j)}, n) for j, n in enumerate(m.accepted_per_pos)])
    lines += _line("spec_decode_acceptance_per_pos", "gauge",
                   "Fraction of verification rounds whose draft position was accepted.",
                   [({"position": str(j)}, n / max(m.num_drafts, 1)) for j, n in enumerate(m.accepted_per_pos)])
    return "\n".join(lines) + "\n"
