"""The native kernels against torch's, on the shipped target's own matmul shapes: every matmul of one forward
(8 layers of fused q/k/v, o, fused gate/up, down, and the LM head) at a few row counts, and one layer's attention
over a cached context. Medians of interleaved repeats, so both sides see the same moments of a noisy machine.

    python scripts/kernel_cost.py [--dtype bf16] [--threads 2] [--context 450]
"""

from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F

from verispec.bench.timing import interleaved, median
from verispec.kernels import native
from verispec.model import load_model
from verispec.model.packing import PACK_ROWS


def interleaved_ms(fns: dict, repeats: int) -> dict[str, float]:
    return {name: 1e3 * median(t) for name, t in interleaved(fns, repeats).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=450)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("native kernels unavailable here (see verispec.kernels.native)")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = load_model("zoo/target", dtype=args.dtype, pack=False)  # fused, not packed
    weights = []
    for layer in model.model.layers:
        weights += [layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_weight,
                    layer.mlp.down_proj.weight]
    weights.append(model.lm_head.weight)
    weights = [w.detach() for w in weights]
    ours = [native.pack(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w.float(), PACK_ROWS) for w in weights]
    print(f"zoo/target matmuls, {args.dtype}, {args.threads} threads: ms per forward's worth (median of "
          f"{args.repeats})")
    print(f"{'rows':>5} {'native':>8} {'oneDNN fp32 pack':>17} {'F.linear':>9}")
    with torch.inference_mode():
        for m in (1, 2, 4, 6, 9, 12, 16, 64):
            xs = [torch.randn(m, w.shape[1]).to(dtype) for w in weights]
            fns = {
                "native": lambda: [native.linear(x, p) for x, p, w in zip(xs, ours, weights)],
                "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x.float(), p, None, "none", [], "").to(dtype)
                                   for x, p in zip(xs, onednn)],
                "torch": lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
            }
            r = interleaved_ms(fns, args.repeats)
            print(f"{m:5d} {r['native']:8.2f} {r['onednn']:17.2f} {r['torch']:9.2f}")
        cfg = model.config
        h, hkv, d, s = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, args.context
        print(f"attention, one layer ({h}/{hkv} heads, head_dim {d}), fp32 cache of {s} + T positions: us")
        for t in (1, 9):
            k, v = torch.randn(1, hkv, s + t, d), torch.randn(1, hkv, s + t, d)
            q = torch.randn(1, t, h, d).transpose(1, 2)
            mask = torch.ones(t, s + t, dtype=torch.bool).tril(s)
            fns = {
                "native": lambda: native.attention(q, k, v, causal=True),
                "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
            }
            r = interleaved_ms(fns, args.repeats * 10)
            print(f"  T={t}: native {1e3 * r['native']:.0f}, torch SDPA {1e3 * r['sdpa']:.0f}")


if __name__ == "__main__":
    main()
