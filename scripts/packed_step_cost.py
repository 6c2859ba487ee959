"""What one packed target forward costs at serving shapes: R requests of T new rows each over C cached positions
(the zoo target in bf16, caches as the engine makes them), medians of interleaved repeats, printed as JSON.

    python scripts/packed_step_cost.py [--points 1x1@160,64x1@160,8x1@1000] [--repeats 12]

An A/B against another commit runs this script in alternating processes, one with that commit's sources first on
the path (`git worktree add /tmp/old COMMIT`, then `PYTHONPATH=/tmp/old/src python scripts/packed_step_cost.py`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from verispec.cache import KVCache
from verispec.model import load_model
from verispec.profile import _time_step

ROOT = Path(__file__).resolve().parents[1]
POINTS = "1x1@160,8x1@160,8x9@160,32x1@160,64x1@16,64x1@160,1x64@160,8x1@1000"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=POINTS, help="RxT@C: R requests of T rows each over C cached positions")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(ROOT / "zoo/target", dtype="bf16")
    points = []
    for p in args.points.split(","):
        shape, ctx = p.split("@")
        r, t = shape.split("x")
        points.append((p, int(r), int(t), int(ctx)))
    longest = max(c + t for _, _, t, c in points)
    prompt = torch.randint(0, target.config.vocab_size, (1, longest), generator=torch.Generator().manual_seed(0))
    caches = [KVCache.for_model(target, max_len=longest + 1) for _ in range(max(r for _, r, _, _ in points))]
    times: dict[str, list[float]] = {name: [] for name, *_ in points}
    with torch.inference_mode():
        for c in caches:
            target(prompt[:, : max(c for *_, c in points)], cache=c, num_logits=0)
        for _ in range(args.repeats):
            for name, r, t, ctx in points:
                for c in caches[:r]:
                    c.length = ctx  # the rows past it hold the same prompt: only their count matters here
                times[name].append(_time_step(target, caches[:r], [t] * r, ctx))
    print(json.dumps({"kv_dtype": str(caches[0].k.dtype), **{k: round(1e3 * statistics.median(v), 3)
                                                             for k, v in times.items()}}))


if __name__ == "__main__":
    main()
