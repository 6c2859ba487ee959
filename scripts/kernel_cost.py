"""What the target's CPU forward costs, against the machine's own ceiling: the streaming read bandwidth (a C read
loop over buffers as large as the model's weights and far larger), the forward's matmuls on every kernel path this
CPU runs and on F.linear, at the row counts of decode, verify and prefill steps, and whole forwards (the native
decoder.c call against the torch path). Medians of interleaved repeats, so every contender sees the same moments
of a noisy machine.

    python scripts/kernel_cost.py [--dtype bf16] [--threads 2] [--context 128] [--repeats 30]
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from verispec.bench.timing import interleaved, median
from verispec.cache import KVCache
from verispec.kernels import native
from verispec.model import load_model


def interleaved_ms(fns: dict, repeats: int) -> dict[str, float]:
    return {name: 1e3 * median(t) for name, t in interleaved(fns, repeats).items()}


def reader(threads: int, nbytes: int):
    """A plain streaming read of an nbytes buffer (scripts/bandwidth.c), as a callable."""
    lib = native.build_library("bandwidth", (Path(__file__).with_name("bandwidth.c"),),
                               ("-O2", "-mavx2", "-fopenmp", "-fPIC", "-shared"))
    lib.vs_read.restype = ctypes.c_float
    lib.vs_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    buf = torch.ones(nbytes // 4)
    return lambda: lib.vs_read(buf.data_ptr(), buf.numel() * 4, threads)


def read_bandwidth(threads: int, sizes_mb: tuple[int, ...], repeats: int) -> dict[int, float]:
    """GB/s of a plain streaming read per buffer size, median of `repeats` passes."""
    return {mb: (mb << 20) / median(interleaved({"read": reader(threads, mb << 20)}, repeats)["read"]) / 1e9
            for mb in sizes_mb}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--target", default="zoo/target")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("native kernels unavailable here (see verispec.kernels.native)")
    isas = [isa for isa in native.ISAS if isa in native.cpu_features()]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = load_model(args.target, dtype=args.dtype)
    weights = []
    for layer in model.model.layers:
        weights += [layer.self_attn.qkv_weight, layer.mlp.gate_up_weight, layer.self_attn.o_proj.weight,
                    layer.mlp.down_proj.weight]
    weights = [w.detach() for w in weights] + [model.lm_head.weight.detach()]
    packs = [native.pack(w) for w in weights]
    nbytes = sum(p.nbytes for p in packs)
    bw = read_bandwidth(args.threads, (max(1, nbytes >> 20), 1024), 15)
    print(f"read bandwidth, {args.threads} threads: " + ", ".join(f"{mb} MiB {g:.1f} GB/s" for mb, g in bw.items()))
    print(f"{args.target} matmuls, {args.dtype}, {args.threads} threads, {nbytes / 1e6:.1f} MB of packed weights: "
          f"ms per forward's worth (GB/s of weights read), median of {args.repeats}")
    print(f"{'rows':>5} " + " ".join(f"{isa:>18}" for isa in isas) + f" {'F.linear':>18}")
    with torch.inference_mode():
        for m in (1, 2, 4, 9, 12, 16, 64):
            xs = [torch.randn(m, w.shape[1]).to(dtype) for w in weights]

            def run(isa):
                def fn():
                    with native.use(isa):
                        for x, p in zip(xs, packs):
                            native.linear(x, p)
                return fn

            fns = {isa: run(isa) for isa in isas}
            fns["torch"] = lambda: [F.linear(x, w) for x, w in zip(xs, weights)]
            r = interleaved_ms(fns, args.repeats)
            print(f"{m:5d} " + " ".join(f"{r[k]:8.2f} ({nbytes / r[k] / 1e6:5.1f})  " for k in fns))
        print(f"whole forwards after {args.context} cached tokens: ms, native decoder.c call vs torch path")
        tokens = torch.randint(0, model.config.vocab_size, (1, args.context + 16))
        cache = KVCache.for_model(model, max_len=args.context + 32)
        model(tokens[:, : args.context], cache=cache)
        fused = model.fused

        def step(rows, path, isa):
            def fn():
                model.fused = fused if path == "native" else None
                with native.use(isa):
                    model(tokens[:, args.context : args.context + rows], cache=cache, num_logits=rows)
                cache.truncate(args.context)
                model.fused = fused
            return fn

        for rows in (1, 9, 16):
            fns = {f"{isa}/{path}": step(rows, path, isa) for isa in isas for path in ("native", "torch")}
            r = interleaved_ms(fns, args.repeats)
            print(f"  {rows:2d} rows: " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
        # The one-row forward against a read of as many bytes as its weights, interleaved: the same footprint
        # against the same 32 MB L3, at the same moments of the machine.
        fns = {"read": reader(args.threads, nbytes), "forward": step(1, "native", isas[-1])}
        r = interleaved_ms(fns, 5 * args.repeats)
        print(f"one-row native forward {r['forward']:.2f} ms ({nbytes / r['forward'] / 1e6:.1f} GB/s of weights) "
              f"against a read of the same {nbytes / 1e6:.1f} MB {r['read']:.2f} ms ({nbytes / r['read'] / 1e6:.1f}"
              f" GB/s): {r['read'] / r['forward']:.0%} of the read bandwidth")


if __name__ == "__main__":
    main()
