"""Hugging Face transformers baselines on the same weights and dtype: `generate` (greedy), assisted
generation with the same draft model (at HF's defaults, and with a constant k and the confidence threshold
off) and prompt lookup. Each is timed interleaved with its verispec counterpart on the same prompts; fp32
token equality with verispec is checked separately."""

from __future__ import annotations

import statistics
import time

import torch

from verispec.bench.core import load_hf_model
from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.model.checkpoint import parse_dtype

PROMPT_LOOKUP_TOKENS = 10  # what HF's docs use for prompt_lookup_num_tokens


def _assistant(model, k: int | None):
    """HF reads the schedule from the assistant's generation_config; None restores HF's defaults."""
    g = model.generation_config
    g.num_assistant_tokens, g.num_assistant_tokens_schedule = (20, "constant") if k is None else (k, "constant")
    g.assistant_confidence_threshold = 0.4 if k is None else 0.0
    return model


def _hf_generate(model, prompt: list[int], n: int, **kw) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def run_baselines(cfg, target, tok, sets, drafters, progress: bool = True) -> list[dict]:
    from tqdm import tqdm

    dtype = parse_dtype(cfg.dtype)
    hf = load_hf_model(cfg.target, dtype)
    draft_spec = next((s for s in drafters if s.startswith("model:")), None)
    hf_draft = load_hf_model(draft_spec.split(":", 1)[1], dtype) if draft_spec else None
    ngram_spec = next((s for s in drafters if s.split(":")[0] == "ngram"), None)
    k_const = 4 if 4 in cfg.ks else cfg.ks[0]
    n = cfg.max_tokens
    params = SamplingParams(max_tokens=n, ignore_eos=True)

    def ours(spec, k):
        return lambda p: decode(target, p, params, drafter=drafters[spec] if spec else None, spec=SpecConfig(k=k))

    systems = {"hf_generate": (lambda p: _hf_generate(hf, p, n), "plain", ours(None, 0))}
    if ngram_spec:
        systems["hf_prompt_lookup"] = (
            lambda p: _hf_generate(hf, p, n, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
            f"{ngram_spec} k={max(cfg.ks)}", ours(ngram_spec, max(cfg.ks)))
    if hf_draft is not None:
        systems["hf_assisted_default"] = (
            lambda p: _hf_generate(hf, p, n, assistant_model=_assistant(hf_draft, None)),
            f"{draft_spec} k={k_const}", ours(draft_spec, k_const))
        systems["hf_assisted_const_k"] = (
            lambda p: _hf_generate(hf, p, n, assistant_model=_assistant(hf_draft, k_const)),
            f"{draft_spec} k={k_const}", ours(draft_spec, k_const))

    records = []
    total = len(systems) * len(sets) * cfg.repeats * cfg.baseline_prompts * 2
    bar = tqdm(total=total, disable=not progress, desc="baselines", unit="gen")
    for name, (theirs, method, mine) in systems.items():
        for task, prompts in sets.items():
            chosen = prompts[: cfg.baseline_prompts]
            t_theirs, t_mine = [], []
            for _ in range(cfg.repeats):
                a = b = 0.0
                for p in chosen:
                    t0 = time.perf_counter()
                    theirs(p)
                    a += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    mine(p)
                    b += time.perf_counter() - t0
                    bar.update(2)
                t_theirs.append(a)
                t_mine.append(b)
            tokens = n * len(chosen)
            tps, ours_tps = tokens / statistics.median(t_theirs), tokens / statistics.median(t_mine)
            records.append({"system": name, "task": task, "tokens_per_s": tps, "verispec_method": method,
                            "verispec_tokens_per_s": ours_tps, "verispec_ratio": ours_tps / tps})
    bar.close()
    equal = _fp32_equality(cfg, sets, systems_with_draft=hf_draft is not None, draft_spec=draft_spec,
                           ngram_spec=ngram_spec, k=k_const)
    for r in records:
        r["equal_tokens_fp32"] = equal.get(r["system"])
    records.append({"system": "fp32_equality_check", "result": equal})
    return records


def _fp32_equality(cfg, sets, systems_with_draft: bool, draft_spec, ngram_spec, k: int) -> dict[str, bool]:
    """On one prompt per task, 32 greedy tokens in fp32: does each HF system produce verispec's tokens?"""
    from verispec.drafters import build_drafter
    from verispec.model import load_model

    target = load_model(cfg.target, "fp32")
    target.source_dir = cfg.target
    hf = load_hf_model(cfg.target, torch.float32)
    hf_draft = load_hf_model(draft_spec.split(":", 1)[1], torch.float32) if systems_with_draft else None
    n, params = 32, SamplingParams(max_tokens=32, ignore_eos=True)
    result = {"hf_generate": True}
    if ngram_spec:
        result["hf_prompt_lookup"] = True
    if hf_draft is not None:
        result["hf_assisted_default"] = result["hf_assisted_const_k"] = True
        drafter = build_drafter(draft_spec, target=target, dtype=torch.float32, device=target.device)
    for prompts in sets.values():
        p = prompts[0][-(target.config.context_limit - n - 1):]
        ours = decode(target, p, params).token_ids
        result["hf_generate"] &= _hf_generate(hf, p, n) == ours
        if ngram_spec:
            result["hf_prompt_lookup"] &= _hf_generate(hf, p, n, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS) == ours
        if hf_draft is not None:
            spec_tokens = decode(target, p, params, drafter=drafter, spec=SpecConfig(k=k)).token_ids
            result["verispec_model_drafter"] = result.get("verispec_model_drafter", True) and spec_tokens == ours
            result["hf_assisted_default"] &= _hf_generate(hf, p, n, assistant_model=_assistant(hf_draft, None)) == ours
            result["hf_assisted_const_k"] &= _hf_generate(hf, p, n, assistant_model=_assistant(hf_draft, k)) == ours
    return result
