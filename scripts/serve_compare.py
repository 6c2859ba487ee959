"""verispec's HTTP server against llama.cpp's llama-server on the same weights, closed loop over HTTP.

    python scripts/serve_compare.py --clients 1,8,32,64 --out reports/serve-zen5

Each arm is a server process on 127.0.0.1 (verispec plain, verispec with the DSpark drafter and policy,
llama-server on the target's bf16 GGUF with continuous batching, restarted per load with one slot per client); C
clients each send their next `/v1/completions` request (greedy, ignore_eos, non-streaming) when the last one
returns, over the last 600 characters of the code task prompts. Per arm and C: aggregate tokens/s (completion
tokens over the wall time) and per-user tokens/s (each request's completion tokens over its latency, averaged);
arms in turn per C, their order reversed every other repeat, medians over repeats. Beside it, in each repeat right
before the servers' runs at one client, the library's own decoding (plain and DSpark, one request at a time, in a
process of its own) on the prompts one client sends: the reference for "the server at 1 client", as per-repeat
ratios. With `--paired N`, each repeat also sends N one-client requests to each verispec server, each right beside
the library's decoding of the same prompt (order alternating), the fairer reference on a host whose speed drifts.
Needs `bash scripts/llamacpp.sh` for the llama-server arm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TARGET, DSPARK = ROOT / "zoo/target", ROOT / "zoo/dspark"


def prompts() -> list[str]:
    from verispec.bench.prompts import load_task

    return [r["prompt"][-600:] for task in ("code_completion", "code_continuation") for r in load_task(task)]


def start(arm: str, port: int, threads: int, slots: int, prefix_cache_mb: int | None = None,
          ) -> tuple[subprocess.Popen, str]:
    """The arm's server process and the model name its requests use (prefix_cache_mb: verispec's prefix cache, None
    for the server's default)."""
    if arm == "llama-server":
        from verispec.bench.llamacpp import build_dir, gguf_file

        binary = build_dir() / "bin" / "llama-server"
        if not binary.is_file():
            raise SystemExit(f"error: no {binary}: run `bash scripts/llamacpp.sh`")
        cmd = [str(binary), "-m", str(gguf_file(TARGET, "bf16")), "-t", str(threads), "-tb", str(threads),
               "-np", str(slots), "-c", str(slots * 512), "--host", "127.0.0.1", "--port", str(port),
               "--no-webui", "-a", "target"]
    else:
        cmd = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port), "--threads", str(threads),
               "--max-running", str(slots)]
        cmd += (["--drafter", "none"] if arm == "verispec plain" else
                ["--drafter", f"dspark:{DSPARK}", "--policy", "dspark", "--k", "8"])
        if prefix_cache_mb is not None:
            cmd += ["--prefix-cache-mb", str(prefix_cache_mb)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(proc, port, arm, "/health" if arm == "llama-server" else "/ready")
    return proc, "target"


def wait_ready(proc: subprocess.Popen, port: int, arm: str, path: str = "/ready") -> None:
    """Until the server on `port` answers `path` with 200; exits with an error if it dies or never does."""
    with httpx.Client(timeout=5) as cl:
        for _ in range(1200):
            try:
                if cl.get(f"http://127.0.0.1:{port}{path}").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise SystemExit(f"error: the {arm} server exited ({proc.returncode}): {' '.join(map(str, proc.args))}")
            time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"error: the {arm} server did not become ready")


async def closed_loop(port: int, model: str, texts: list[str], clients: int, per_client: int,
                      max_tokens: int, vary: bool = False) -> dict:
    """`vary`: request lengths spread over max_tokens - 8 .. + 8 (as scripts/engine_ab.py --vary), so that clients do
    not finish together: with one length, plain decoding keeps C clients in lockstep and prefills their next prompts
    in one step, which a drafting arm (its rounds commit different counts) cannot."""
    lat, toks = [], []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as cl:
        async def client(c: int) -> None:
            for j in range(per_client):
                n = max_tokens - 8 + (c * 7 + j * 5) % 17 if vary else max_tokens
                body = {"model": model, "prompt": texts[(c * 7 + j) % len(texts)], "max_tokens": n,
                        "temperature": 0.0, "ignore_eos": True}
                t0 = time.perf_counter()
                r = await cl.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                r.raise_for_status()
                lat.append(time.perf_counter() - t0)
                toks.append(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        wall = time.perf_counter() - t0
    return {"aggregate": sum(toks) / wall, "per_user": statistics.mean(n / s for n, s in zip(toks, lat)),
            "requests": len(lat), "tokens": sum(toks)}


def engine_counters(port: int) -> dict[str, float]:
    """The verispec server's step and prefix-cache counters from /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        for name in ("engine_steps", "engine_undrafted_steps", "prefix_cache_queries", "prefix_cache_hits"):
            if line.startswith(f"verispec:{name}_total "):
                out[name] = float(line.split()[-1])
    return out


class Library:
    """The library's own decoding in a process of its own, one request at a time, for the references of "the server
    at 1 client": plain decoding and the DSpark drafter under the dspark policy (k 8), the two interleaved per
    prompt. It stays loaded and runs when asked, so that each repeat measures it right beside the servers' runs at
    one client, on the very prompts those runs send (a reference measured minutes apart drifted with the host)."""

    def __init__(self, texts: list[str], max_tokens: int, threads: int) -> None:
        code = f"""
import json, sys, time, torch
from verispec.config import SamplingParams, SpecConfig
from verispec.decode import decode
from verispec.drafters.base import build_drafter
from verispec.model.checkpoint import load_model
from verispec.model.tokenizer import Tokenizer
torch.set_num_threads({threads})
t = load_model({str(TARGET)!r}, dtype="bf16"); tok = Tokenizer.from_dir({str(TARGET)!r})
d = build_drafter({"dspark:" + str(DSPARK)!r}, target=t, dtype=t.dtype, device=t.device)
p = SamplingParams(max_tokens={max_tokens}, temperature=0.0, ignore_eos=True)
arms = {{"plain": {{}}, "dspark": {{"drafter": d, "spec": SpecConfig(k=8, policy="dspark")}}}}
texts = {texts!r}
for kw in arms.values():
    decode(t, tok.encode(texts[0]), p, **kw)
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("one "):  # one request: "one ARM INDEX" -> its tokens and seconds
        _, a, i = line.split()
        t0 = time.perf_counter()
        n = len(decode(t, tok.encode(texts[int(i)]), p, **arms[a]).token_ids)
        print(json.dumps({{"tokens": n, "seconds": time.perf_counter() - t0}}), flush=True)
        continue
    tokens, seconds = {{a: 0 for a in arms}}, {{a: 0.0 for a in arms}}
    for x in texts:
        for a, kw in arms.items():
            t0 = time.perf_counter()
            tokens[a] += len(decode(t, tok.encode(x), p, **kw).token_ids)
            seconds[a] += time.perf_counter() - t0
    print(json.dumps({{a: tokens[a] / seconds[a] for a in arms}}), flush=True)
"""
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("error: the library reference process failed to start")

    def run(self) -> dict[str, float]:
        """tokens/s over the prompts (all tokens over all time, as the server's aggregate), plain and dspark."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def one(self, arm: str, index: int) -> tuple[int, float]:
        """One request of the reference's prompts (`texts[index]`) with one arm: its tokens and seconds."""
        self.proc.stdin.write(f"one {arm} {index}\n")
        self.proc.stdin.flush()
        r = json.loads(self.proc.stdout.readline())
        return r["tokens"], r["seconds"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def paired(port: int, model: str, reference: Library, arm: str, texts: list[str], n: int,
           max_tokens: int) -> dict[str, float]:
    """One client's requests to a server paired with the library's decoding of the same prompt, back to back, the
    order alternating: tokens/s of each side over the same n prompts. The per-repeat references run minutes'
    worth of requests apart from the server's, and this host's speed moves by +-10% over that span."""
    sums = {"server": [0, 0.0], "library": [0, 0.0]}
    with httpx.Client(timeout=600) as cl:
        for j in range(n):
            for side in (("server", "library") if j % 2 == 0 else ("library", "server")):
                if side == "library":
                    tokens, seconds = reference.one(arm, j % len(texts))
                else:
                    body = {"model": model, "prompt": texts[j % len(texts)], "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True}
                    t0 = time.perf_counter()
                    r = cl.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
                    r.raise_for_status()
                    seconds = time.perf_counter() - t0
                    tokens = r.json()["usage"]["completion_tokens"]
                sums[side][0] += tokens
                sums[side][1] += seconds
    return {side: tokens / seconds for side, (tokens, seconds) in sums.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--arms", default="verispec plain,verispec dspark,llama-server")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--requests", type=int, default=64, help="requests per arm and load (at least 2 per client)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-cache-mb", type=int, default=None,
                    help="verispec's prefix cache (0: off, as the library reference has none; default: the server's)")
    ap.add_argument("--paired", type=int, default=0,
                    help="per repeat, this many one-client requests to each verispec server, each paired with the "
                         "library's decoding of the same prompt (the 1-client goals, measured side by side; needs 1 "
                         "in --clients, and --prefix-cache-mb 0 for a fair reference: the prompts repeat)")
    ap.add_argument("--vary", action="store_true",
                    help="request lengths max_tokens - 8 .. + 8, so that the clients do not finish in lockstep")
    ap.add_argument("--out", type=Path, default=ROOT / "reports/serve-compare")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    arms = [a.strip() for a in args.arms.split(",")]
    if args.paired and 1 not in clients:
        ap.error("--paired measures the one-client goals: include 1 in --clients")
    texts = prompts()
    ports = {arm: 8700 + i for i, arm in enumerate(arms)}
    # verispec's servers run throughout; llama-server is started per load with one slot per client (its KV cache
    # is split over its slots, and spare slots cost it: -np 64 ran 8 clients at two thirds the speed of -np 8).
    servers = {arm: start(arm, ports[arm], args.threads, max(clients), args.prefix_cache_mb)
               for arm in arms if arm != "llama-server"}
    rows = []

    def run(arm: str, c: int, rep: int) -> None:
        if arm == "llama-server":
            servers[arm] = start(arm, ports[arm], args.threads, c)
            asyncio.run(closed_loop(ports[arm], "target", texts, 1, 1, args.max_tokens))  # warm-up
        before = engine_counters(ports[arm]) if arm != "llama-server" else {}
        try:
            r = asyncio.run(closed_loop(ports[arm], servers[arm][1], texts, c, max(2, args.requests // c),
                                        args.max_tokens, args.vary))
            if before:  # the engine's steps, and those that drafted (the dspark arm's gate)
                after = engine_counters(ports[arm])
                r["steps"] = after["engine_steps"] - before["engine_steps"]
                r["drafted_steps"] = r["steps"] - (after["engine_undrafted_steps"] - before["engine_undrafted_steps"])
                if arm == "verispec plain":
                    r["drafted_steps"] = 0
                # prompt tokens looked up and found: the arms' prefill work differs with their prefix-cache hits
                r["prefix_queried"] = after["prefix_cache_queries"] - before["prefix_cache_queries"]
                r["prefix_hits"] = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        finally:
            if arm == "llama-server":
                proc = servers.pop(arm)[0]
                proc.terminate()
                proc.wait()
        rows.append({"arm": arm, "clients": c, "repeat": rep, **r})
        steps = f"  steps {r['steps']} drafted {r['drafted_steps']}" if "steps" in r else ""
        print(f"{arm:16s} C={c:3d} aggregate {r['aggregate']:7.1f} tok/s  per-user {r['per_user']:6.1f}{steps}",
              flush=True)

    # the prompts one client sends (closed_loop: client 0's j-th request), for the library reference
    reference_texts = [texts[j % len(texts)] for j in range(max(2, args.requests))]
    reference = Library(reference_texts, args.max_tokens, args.threads)
    lib, pairs = [], []
    try:
        for arm, (proc, model) in servers.items():  # warm-up: one request each
            asyncio.run(closed_loop(ports[arm], model, texts, 1, 1, args.max_tokens))
        for rep in range(args.repeats):
            for c in clients:
                if c == 1:
                    lib.append({"repeat": rep, **reference.run()})
                    for arm in (a for a in arms if a != "llama-server") if args.paired else ():
                        kind = "plain" if arm == "verispec plain" else "dspark"
                        r = paired(ports[arm], servers[arm][1], reference, kind, reference_texts, args.paired,
                                   args.max_tokens)
                        pairs.append({"repeat": rep, "arm": arm, **r})
                for arm in (arms if rep % 2 == 0 else arms[::-1]):  # order flipped per repeat: drift hits both
                    run(arm, c, rep)
    finally:
        reference.close()
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"rows": rows, "library": lib, "paired": pairs}, indent=1))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((l.split(":", 1)[1].strip() for l in cpu.splitlines() if l.startswith("Model name")), "?")
    flags = next((l.split(":", 1)[1].split() for l in cpu.splitlines() if l.startswith("Flags")), [])
    out = ["# verispec serve vs llama-server, closed loop over HTTP", "",
           f"Machine: {model}, {args.threads} threads, flags `{' '.join(f for f in flags if f.startswith(('avx', 'amx')))}`;"
           f" Python {platform.python_version()}. Command: `python scripts/serve_compare.py --clients {args.clients} "
           f"--arms '{args.arms}' --max-tokens {args.max_tokens} --requests {args.requests} --repeats {args.repeats}"
           + ("" if args.prefix_cache_mb is None else f" --prefix-cache-mb {args.prefix_cache_mb}")
           + (f" --paired {args.paired}" if args.paired else "") + (" --vary" if args.vary else "") + "`.", "",
           *_library(lib), *_one_client(rows, lib), *_paired(pairs, args.paired), "",
           "| clients | " + " | ".join(f"{a} aggregate | {a} per-user" for a in arms) + " |",
           "|---|" + "---|---|" * len(arms)]
    for c in clients:
        cells = []
        for a in arms:
            sel = [r for r in rows if r["arm"] == a and r["clients"] == c]
            cells += [f"{statistics.median(r['aggregate'] for r in sel):.1f}",
                      f"{statistics.median(r['per_user'] for r in sel):.1f}"]
        out.append(f"| {c} | " + " | ".join(cells) + " |")
    gated = [r for r in rows if r["arm"] == "verispec dspark" and r.get("steps")]
    if gated:
        out += ["", "The dspark server's steps that drafted (its draft gate), per load over all repeats: " + ", ".join(
            f"{c} clients {sum(r['drafted_steps'] for r in gated if r['clients'] == c):.0f} of "
            f"{sum(r['steps'] for r in gated if r['clients'] == c):.0f}" for c in clients) + "."]
    hits = [r for r in rows if r.get("prefix_queried")]
    if hits:
        out += ["", "Prompt tokens found in the prefix cache, per arm and load over all repeats: " + "; ".join(
            f"{a} " + ", ".join(f"{c} clients {_share(hits, a, c):.0%}" for c in clients)
            for a in arms if any(r["arm"] == a for r in hits)) + "."]
    (args.out / "summary.md").write_text("\n".join(out) + "\n")
    print("\n".join(out))


def _library(lib: list[dict]) -> list[str]:
    """The library's reference line (measured only in runs that include one client)."""
    if not lib:
        return []

    def runs(arm: str) -> str:
        return ", ".join(f"{x[arm]:.0f}" for x in lib)

    return [f"The library on the prompts one client sends (one request at a time, plain and dspark interleaved per "
            f"prompt, run in each repeat right before the servers' runs at one client; tokens over time, prefill "
            f"included): plain {statistics.median(x['plain'] for x in lib):.1f} tok/s (runs: {runs('plain')}), "
            f"`dspark:zoo/dspark` with the dspark policy (k 8) {statistics.median(x['dspark'] for x in lib):.1f} "
            f"(runs: {runs('dspark')}); speedup {statistics.median(x['dspark'] / x['plain'] for x in lib):.2f}x."]


def _paired(pairs: list[dict], n: int) -> list[str]:
    """The 1-client goals from requests paired with the library's (`paired`), per repeat and their medians."""
    plain = [x["server"] / x["library"] for x in pairs if x["arm"] == "verispec plain"]
    out = []
    if plain:
        out.append(f"Paired, {n} one-client requests per repeat each beside the library's decoding of the same prompt: "
                   f"the plain server at {', '.join(f'{r:.2f}' for r in plain)}x the library's plain (median "
                   f"{statistics.median(plain):.2f}x; goal >= 0.90).")
    share = []
    for rep in sorted({x["repeat"] for x in pairs}):
        p = next((x for x in pairs if x["repeat"] == rep and x["arm"] == "verispec plain"), None)
        d = next((x for x in pairs if x["repeat"] == rep and x["arm"] == "verispec dspark"), None)
        if p and d:
            share.append((d["server"] / p["server"]) / (d["library"] / p["library"]))
    if share:
        out.append(f"The dspark server's speedup over the plain server, as a share of the library's, paired: "
                   f"{', '.join(f'{r:.2f}' for r in share)} (median {statistics.median(share):.2f}; goal >= 0.90).")
    return [" ".join(out)] if out else []


def _share(rows: list[dict], arm: str, clients: int) -> float:
    sel = [r for r in rows if r["arm"] == arm and r["clients"] == clients]
    return sum(r["prefix_hits"] for r in sel) / max(sum(r["prefix_queried"] for r in sel), 1)


def _one_client(rows: list[dict], lib: list[dict]) -> list[str]:
    """The goals at one client, each a median of per-repeat ratios (the library run beside that repeat's)."""
    def at1(arm: str, rep: int) -> float | None:
        return next((r["aggregate"] for r in rows if r["arm"] == arm and r["clients"] == 1 and r["repeat"] == rep),
                    None)

    plain, spec = [], []
    for x in lib:
        p, d = at1("verispec plain", x["repeat"]), at1("verispec dspark", x["repeat"])
        if p:
            plain.append(p / x["plain"])
        if p and d:
            spec.append((d / p) / (x["dspark"] / x["plain"]))
    out = []
    if plain:
        out.append(f"Per repeat, the plain server at 1 client against the library's plain: "
                   f"{', '.join(f'{r:.2f}' for r in plain)}x (median {statistics.median(plain):.2f}x; goal >= 0.90).")
    if spec:
        out.append(f"The dspark server's speedup over the plain server at 1 client, as a share of the library's: "
                   f"{', '.join(f'{r:.2f}' for r in spec)} (median {statistics.median(spec):.2f}; goal >= 0.90).")
    return [" ".join(out)] if out else []


if __name__ == "__main__":
    main()
