"""Weight-only int8 / int4 matmuls on the CPU, side by side: verispec's qgemm.c (native.qlinear) against PyTorch's
CPU kernels (aten._weight_int8pack_mm, per channel; aten._weight_int4pack_mm_for_cpu, group-wise), its W4A8 path
(the same int4 weights, the input rounded to int8 per group: `ours w4a8`) and verispec's
bf16 gemm (native.linear on a bf16 pack), on the zoo target's matmul shapes at decode/verify row counts, bf16
activations. Each shape runs over one weight per decoder layer (as a forward reads them: not one hot copy), and
"forward" is all of a forward's layer matmuls; µs are per matmul (per forward for "forward"), the median and the
best of interleaved repeats (on a shared 2-vCPU machine a 2-thread call whose second thread is descheduled waits
a time slice: the best shows the uncontended cost), GB/s of weight bytes (scales included) at the best. Then whether each kernel's rows are batch-invariant:
does a row's output change with the number of rows in the call?

    python scripts/qgemm_cost.py [--threads 2] [--repeats 30] [--target zoo/target] [--rows 1,2,4,8,16]

(`--rows 600` times a prefill-sized call.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from verispec.bench.timing import interleaved, median
from verispec.kernels import native

BF16 = torch.bfloat16
ROWS = (1, 2, 4, 8, 16)


def shapes(target: str) -> dict[str, tuple[int, int]]:  # name -> (N, K)
    c = json.loads((Path(target) / "config.json").read_text())
    d, f, hd = c["hidden_size"], c["intermediate_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd
    return {"qkv": (qkv, d), "o": (d, c["num_attention_heads"] * hd), "gate_up": (2 * f, d), "down": (d, f)}


def arms(n: int, k: int, seed: int) -> dict[str, tuple[object, int]]:
    """name -> (a function of x [M, K] bf16, weight bytes it reads), for one random weight."""
    g = torch.Generator().manual_seed(seed)
    q4 = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    out: dict[str, tuple[object, int]] = {}
    s8 = torch.rand(n, 1, generator=g) / 128
    p8 = native.qpack(q8, s8, k, 8)
    out["ours int8"] = (lambda x, p=p8: native.qlinear(x, p), p8.nbytes)
    s8b = s8[:, 0].to(BF16)
    out["torch int8"] = (lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, s8b), n * k + 2 * n)
    for group in (32, 128):
        s4 = torch.rand(n, k // group, generator=g) / 8
        p4 = native.qpack(q4, s4, group, 4)
        out[f"ours int4 g{group}"] = (lambda x, p=p4: native.qlinear(x, p), p4.nbytes)
        a8 = native.qpack(q4, s4, group, 4, act_bits=8)  # the same weights, the input rounded to int8 (W4A8)
        out[f"ours w4a8 g{group}"] = (lambda x, p=a8: native.qlinear(x, p), a8.nbytes)
        w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q4.int() + 8).contiguous(), 2)
        sz = torch.stack([s4.T, torch.zeros_like(s4.T)], -1).to(BF16).contiguous()  # [K / group, N, 2]
        out[f"torch int4 g{group}"] = (lambda x, w=w4, s=sz, gr=group: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, w, gr, s), n * k // 2 + 4 * n * (k // group))
    pb = native.pack(torch.randn(n, k, generator=g).to(BF16))
    out["ours bf16"] = (lambda x, p=pb: native.linear(x, p), pb.nbytes)
    return out


def batch_invariant(fn, k: int) -> bool:
    """Whether every row of calls over 1..16, 32 and 64 rows equals that row computed alone."""
    x = torch.randn(64, k).to(BF16)
    alone = torch.cat([fn(x[i : i + 1]) for i in range(64)])
    return all(torch.equal(fn(x[:m]), alone[:m]) for m in (*range(2, 17), 32, 64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--target", default="zoo/target")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    if not native.qavailable():
        raise SystemExit("native kernels unavailable here (see verispec.kernels.native)")
    layers = json.loads((Path(args.target) / "config.json").read_text())["num_hidden_layers"]
    shp = shapes(args.target)
    # per shape, per layer: arm -> (fn, bytes)
    weights = {name: [arms(n, k, 100 * i + j) for i in range(layers)] for j, (name, (n, k)) in enumerate(shp.items())}
    names = list(weights["qkv"][0])
    print(f"{args.target}: {layers} layers, bf16 x, {args.threads} threads, isa {native.isa()}, median of "
          f"{args.repeats} interleaved; per cell: median / best µs (GB/s of weight bytes at the best)")
    print(f"{'shape':>16} {'M':>3} " + " ".join(f"{a:>22}" for a in names))
    with torch.inference_mode():
        for label in [*shp, "forward"]:
            parts = list(shp) if label == "forward" else [label]
            calls = [(shp[p][1], w) for p in parts for w in weights[p]]
            for m in rows:
                xs = {kk: torch.randn(m, kk).to(BF16) for kk in {kk for kk, _ in calls}}
                fns = {a: (lambda a=a: [w[a][0](xs[kk]) for kk, w in calls]) for a in names}
                per = 1 if label == "forward" else layers
                runs = interleaved(fns, args.repeats)
                t = {a: median(v) / per for a, v in runs.items()}
                best = {a: min(v) / per for a, v in runs.items()}
                nbytes = {a: sum(w[a][1] for _, w in calls) / (1 if label == "forward" else layers) for a in names}
                dims = "x".join(map(str, shp[label])) if label != "forward" else f"{len(calls)} matmuls"
                print(f"{label + ' ' + dims:>16} {m:3d} " + " ".join(
                    f"{1e6 * t[a]:7.0f} /{1e6 * best[a]:6.0f} ({nbytes[a] / best[a] / 1e9:4.1f})" for a in names))
        print("batch-invariant (each row of 1..16, 32, 64-row calls equals that row alone), per shape:")
        for a in names:
            res = {p: batch_invariant(weights[p][0][a][0], shp[p][1]) for p in shp}
            print(f"  {a:>16}: " + ", ".join(f"{p} {'yes' if r else 'NO'}" for p, r in res.items()))


if __name__ == "__main__":
    main()
