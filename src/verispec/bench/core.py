"""Core benchmark: verispec plain decoding vs Hugging Face `generate` on the same weights, prompt-lookup
speedup on a self-repeating prompt, and the per-forward overhead of a tiny model.

Run: `verispec bench core [--repeats 5] [--out results/core]`. Writes core.json and core.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from verispec.bench.checkpoints import RANDOM_50M, RANDOM_TINY, make_random_checkpoint
from verispec.bench.timing import interleaved, median
from verispec.cache import KVCache
from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters import NgramDrafter
from verispec.model import load_model
from verispec.model.tokenizer import Tokenizer

PROMPT = (Path(__file__).resolve().parents[3] / "scripts" / "demo_prompt.py")


def load_hf_model(path: Path | str, dtype: torch.dtype):
    """A local checkpoint as a Hugging Face model (for baselines and parity), from safetensors only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, use_safetensors=True).eval()


def _hf_generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
        )
    return out[0, len(prompt):].tolist()


def _forward_ms(fn, repeats: int = 50) -> float:
    return median(next(iter(interleaved({"f": fn}, repeats, warmup=5).values()))) * 1e3


def run(cache_dir: Path, repeats: int, new_tokens: int, threads: int | None) -> dict:
    if threads:
        torch.set_num_threads(threads)
    big = make_random_checkpoint(cache_dir / "random-50m", RANDOM_50M)
    tok = Tokenizer.from_dir(big)
    prompt = tok.encode(PROMPT.read_text()) if PROMPT.is_file() else list(range(3, 67))
    report: dict = {"threads": torch.get_num_threads(), "new_tokens": new_tokens, "prompt_tokens": len(prompt)}

    # 1. fp32: the two implementations must produce the same greedy tokens.
    ours32, hf32 = load_model(big, "fp32"), load_hf_model(big, torch.float32)
    ours_tokens = decode(ours32, prompt, SamplingParams(max_tokens=32, ignore_eos=True)).token_ids
    report["fp32_equal_to_hf"] = ours_tokens == _hf_generate(hf32, prompt, 32)
    del ours32, hf32

    # 2. bf16 plain decoding and prompt lookup, interleaved with HF generate.
    ours, hf = load_model(big, "bf16"), load_hf_model(big, torch.bfloat16)
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    results = {}

    def run_ours(name, drafter=None, k=0):
        def fn():
            results[name] = decode(ours, prompt, params, drafter=drafter, spec=SpecConfig(k=k))
        return fn

    times = interleaved(
        {
            "hf_generate": lambda: results.__setitem__("hf", _hf_generate(hf, prompt, new_tokens)),
            "verispec_plain": run_ours("plain"),
            "verispec_ngram_k8": run_ours("ngram", NgramDrafter(), 8),
        },
        repeats,
    )
    tps = {name: new_tokens / median(ts) for name, ts in times.items()}
    report["tokens_per_s"] = tps
    report["plain_vs_hf"] = tps["verispec_plain"] / tps["hf_generate"]
    report["ngram_speedup_vs_plain"] = tps["verispec_ngram_k8"] / tps["verispec_plain"]
    report["ngram_tau"] = results["ngram"].stats.tau
    report["ngram_equal_to_plain"] = results["ngram"].token_ids == results["plain"].token_ids
    report["bf16_plain_equal_to_hf"] = results["plain"].token_ids == results["hf"]

    # 3. Per-forward cost of a tiny model (overhead-dominated), one token after a 64-token prefix.
    tiny = make_random_checkpoint(cache_dir / "random-tiny", RANDOM_TINY)
    forward = {}
    for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        m = load_model(tiny, dtype_name)
        cache = KVCache.for_model(m)
        x = torch.arange(3, 67)[None]
        with torch.inference_mode():
            m(x, cache=cache)

            def step():
                m(x[:, :1], cache=cache)
                cache.truncate(64)

            forward[f"verispec_{dtype_name}_ms"] = _forward_ms(step)
            h = load_hf_model(tiny, dtype)
            past = h(x, use_cache=True).past_key_values

            def hf_step():
                h(x[:, :1], past_key_values=past, use_cache=True)
                past.crop(-1)

            forward[f"hf_{dtype_name}_ms"] = _forward_ms(hf_step)
    report["tiny_forward"] = forward
    return report


def to_markdown(r: dict) -> str:
    t = r["tokens_per_s"]
    f = r["tiny_forward"]
    return "\n".join([
        f"# Core benchmark (random-init ~49M Llama, bf16, {r['threads']} threads, {r['new_tokens']} new tokens, "
        f"{r['prompt_tokens']}-token prompt, medians)",
        "",
        "| system | tokens/s |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in t.items()],
        "",
        f"- verispec plain / HF generate: **{r['plain_vs_hf']:.2f}x**",
        f"- ngram k=8 / verispec plain: **{r['ngram_speedup_vs_plain']:.2f}x** (tau {r['ngram_tau']:.2f}, "
        f"equal to plain: {r['ngram_equal_to_plain']})",
        f"- fp32 greedy tokens equal to HF: {r['fp32_equal_to_hf']}; bf16: {r['bf16_plain_equal_to_hf']}",
        f"- tiny model (1.4M) one-token forward: verispec fp32 {f['verispec_fp32_ms']:.2f} ms, "
        f"bf16 {f['verispec_bf16_ms']:.2f} ms; HF fp32 {f['hf_fp32_ms']:.2f} ms, bf16 {f['hf_bf16_ms']:.2f} ms",
        "",
    ])


def main(out: Path, repeats: int, new_tokens: int, threads: int | None, cache_dir: Path) -> int:
    report = run(cache_dir, repeats, new_tokens, threads)
    out.mkdir(parents=True, exist_ok=True)
    (out / "core.json").write_text(json.dumps(report, indent=2) + "\n")
    md = to_markdown(report)
    (out / "core.md").write_text(md)
    print(md)
    return 0
