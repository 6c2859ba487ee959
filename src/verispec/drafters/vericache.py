"""VeriCache: the target drafts for itself from a compressed view of its own KV cache (self-speculation).

The drafter is the target's own weights (or the same model's int4 checkpoint: QuantSpec's doubly lossy view)
decoding over a `CompressedView` of the target's cache, which the decode loop or engine lends it
(`capabilities.reads_target_kv`). The view follows the full cache from the rows the target's own forwards wrote,
so no round prefills twice; the full cache verifies, so the output is the target's, token for token under greedy
decoding and in distribution under sampling (each drafted token's q row is the compressed model's distribution).

Composition (TriForce's hierarchy): with `draft=SPEC`, a cheap drafter drafts for the compressed-KV model, which
verifies it over the view (one forward per inner round, the same lossless rules), and the inner rounds' committed
tokens are this drafter's proposal. The inner drafter hears every inner round and is rolled back to what the outer
verification kept (`Drafter.rollback`), so no special case lives in decode or the engine.

Horizon: `horizon=adaptive` picks each round's length N to maximise expected committed tokens per second,
E(N) / (sync_s + N * draft_s + verify_s(N + 1)), with E(N) = sum_{j<=N} a^j for the per-token acceptance a learnt
from recent rounds, the view's sync and the drafting cost per token measured here, and the verify cost measured as the time between a
proposal and its verification's result (a linear fit in the rows verified, refit as the context grows). N grows
while rounds are fully accepted and shrinks after early rejections; `horizon=fixed` drafts the whole budget.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from verispec.cache import KVCache, PackedBatch
from verispec.cache.compress import CompressedView, Compressor, budget_bytes, make_compressor
from verispec.drafters.base import (
    EMPTY_DRAFT, Capabilities, Draft, Drafter, DraftRequest, Verified, build_drafter, register_drafter,
)
from verispec.errors import CheckpointError, ConfigError
from verispec.model.checkpoint import load_model
from verispec.model.transformer import Transformer
from verispec.sampling import greedy, probs_for
from verispec.verify import verify_chain

ARCH_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "intermediate_size")


@dataclass
class Horizon:
    """Chooses a round's draft length from the measured costs and the recent acceptance (see the module doc)."""

    adaptive: bool = True
    prior: float = 0.8  # per-token acceptance before any round
    decay: float = 0.7  # weight of the past in the acceptance and cost averages
    accepted: float = 4.0  # decayed sums: draft tokens accepted, and rounds that ended in a rejection
    rejected: float = 1.0
    draft_s: float = 0.0  # per drafted token (moving average)
    verify: deque = field(default_factory=lambda: deque(maxlen=16))  # (rows verified, seconds)

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    sync_s: float = 0.0  # the view's sync per drafting round (moving average; a retrieval view's rebuild)
    rounds: int = 0
    probe_every: int = 8  # a round that chose not to draft drafts anyway this often, to keep measuring

    def record_sync(self, seconds: float) -> None:
        self.sync_s = seconds if not self.sync_s else self.decay * self.sync_s + (1 - self.decay) * seconds

    def record(self, proposed: int, accepted: int, draft_s: float, verify_s: float | None) -> None:
        self.rounds += 1
        if verify_s is not None:
            self.verify.append((proposed + 1, verify_s))
        if proposed <= 0:
            return
        self.accepted = self.decay * self.accepted + accepted
        self.rejected = self.decay * self.rejected + (accepted < proposed)
        per_token = draft_s / proposed
        self.draft_s = per_token if not self.draft_s else self.decay * self.draft_s + (1 - self.decay) * per_token

    def verify_s(self, rows: int) -> float:
        """A least-squares line through the recent (rows, seconds), its slope at least that of a step whose fixed
        part is half its cost at 9 rows (this CPU's verify-cost shape: a verified row costs real compute). Without
        the floor, noise over nearly equal row counts fits a flat line and every horizon looks free to verify."""
        pts = list(self.verify)
        if not pts:
            return 0.0
        xs = [r for r, _ in pts]
        mean_x, mean_y = sum(xs) / len(xs), sum(t for _, t in pts) / len(pts)
        var = sum((x - mean_x) ** 2 for x in xs)
        slope = mean_y / (mean_x + 9)
        if var > 0:
            slope = max(slope, sum((x - mean_x) * (t - mean_y) for x, t in pts) / var)
        return max(mean_y + slope * (rows - mean_x), 1e-6)

    def choose(self, budget: int) -> int:
        """The N in 0..budget with the most expected tokens per second; 0 (a plain step) when drafting cannot
        pay, except every `probe_every` rounds, which draft the best N > 0 to keep its costs measured."""
        if not self.adaptive or budget <= 1 or not self.draft_s or not self.verify:
            return budget
        a = min(self.acceptance, 0.999)

        def rate(n: int) -> float:
            return (1 - a ** (n + 1)) / (1 - a) / ((n > 0) * self.sync_s + n * self.draft_s + self.verify_s(n + 1))

        best = max(range(1, budget + 1), key=rate)
        if rate(best) < rate(0) and self.rounds % self.probe_every:
            return 0
        return best


@dataclass
class _Sequence:
    view: CompressedView | None = None
    num_tokens: int = 0  # committed tokens known to the drafter
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # {hidden layer: [w, d]} last prompt rows
    query_start: int = 0  # the position of those rows' first
    horizon: Horizon = field(default_factory=Horizon)
    proposed: int = 0  # the last proposal's length, its drafting time, and when it was returned
    draft_s: float = 0.0
    proposed_at: float | None = None


class VeriCacheDrafter(Drafter):
    name = "vericache"

    def __init__(
        self,
        model: Transformer,  # the target, or a quantized copy of it (same architecture)
        compressor: dict,  # make_compressor's arguments: a fresh compressor per sequence
        inner: Drafter | None = None,
        inner_k: int = 8,
        adaptive: bool = True,
        rule: str = "rejection",
    ) -> None:
        self.model, self.inner, self.inner_k, self.adaptive, self.rule = model, inner, inner_k, adaptive, rule
        self._compressor = dict(compressor)
        probe = self.make_compressor()
        self.budget = probe.budget
        layers = set(inner.capabilities.hidden_layers) if inner is not None else set()
        if probe.needs_queries:  # each layer's input: hidden index l is layer l + 1's input
            layers |= set(range(model.config.num_hidden_layers))
        self.capabilities = Capabilities(hidden_layers=tuple(sorted(layers)), reads_target_kv=True)
        self._inner_layers = set(inner.capabilities.hidden_layers) if inner is not None else set()
        self._query_layers = probe.needs_queries
        self._seqs: dict[int, _Sequence] = {}
        self.stats = {"rounds": 0, "drafted": 0, "inner_rounds": 0}

    def make_compressor(self) -> Compressor:
        c = dict(self._compressor)
        return make_compressor(c.pop("name"), c.pop("budget"), **c)

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self, seq_id: int, prompt: list[int]) -> None:
        self._seqs[seq_id] = _Sequence(num_tokens=len(prompt), horizon=Horizon(adaptive=self.adaptive))
        if self.inner is not None:
            self.inner.start(seq_id, prompt)

    def attach_cache(self, seq_id: int, cache: KVCache) -> None:
        # Room past the budget: a sync's chunk (a whole prefill chunk arrives at once) and a round's drafted rows.
        self._seqs[seq_id].view = CompressedView(cache, self.make_compressor(), headroom=512)

    def observe(self, seq_id: int, start: int, hidden: dict[int, torch.Tensor]) -> None:
        if self.inner is not None:
            self.inner.observe(seq_id, start, {k: h for k, h in hidden.items() if k in self._inner_layers})
        if self._query_layers:
            self._remember(self._seqs[seq_id], start, hidden)

    def _remember(self, seq: _Sequence, start: int, hidden: dict[int, torch.Tensor]) -> None:
        """Keep each layer's input at the last committed positions (rows for start..): the compressor's queries."""
        keep = 32
        rows = next(iter(hidden.values())).shape[0]
        for layer in range(self.model.config.num_hidden_layers):
            old = seq.queries.get(layer)
            both = hidden[layer] if old is None else torch.cat([old, hidden[layer]])
            seq.queries[layer] = both[-keep:]
        seq.query_start = start + rows - seq.queries[0].shape[0]

    def finish(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        if self.inner is not None:
            self.inner.finish(seq_id)

    def live_sequences(self) -> set[int]:
        inner = self.inner.live_sequences() if self.inner is not None else set()
        return set(self._seqs) | inner

    def rollback(self, seq_id: int, num_tokens: int) -> None:
        self._seqs[seq_id].num_tokens = min(self._seqs[seq_id].num_tokens, num_tokens)
        if self.inner is not None:
            self.inner.rollback(seq_id, num_tokens)

    # ---- drafting ----------------------------------------------------------------------------------------
    def _queries(self, seq: _Sequence, window: int):
        """SnapKV's QueryFn: layer l's queries [1, H, w, D] of the last observed rows (at their positions)."""
        def fn(layer: int) -> torch.Tensor:
            h = seq.queries[layer][-window:]
            mod = self.model.model.layers[layer]
            pos = torch.arange(seq.query_start + seq.queries[layer].shape[0] - h.shape[0],
                               seq.query_start + seq.queries[layer].shape[0], device=h.device)[None]
            x = mod.input_layernorm(h[None].to(self.model.dtype))
            cos, sin = self.model.model.rotary_emb(pos, x.dtype)
            return mod.self_attn._qkv(x, cos, sin)[0]  # noqa: SLF001  (the layer's own q projection and RoPE)
        return fn

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        drafts = [EMPTY_DRAFT] * len(requests)
        # Greedy sequences without an inner drafter draft in lockstep: one packed forward a step over all views
        # (N steps of B rows instead of B x N one-row steps). The rest draft one by one.
        together = [i for i, r in enumerate(requests) if r.budget > 0 and self.inner is None and r.params.greedy]
        if len(together) < 2:
            together = []
        for i, d in zip(together, self._propose_greedy_together([requests[i] for i in together])):
            drafts[i] = d
        alone = set(range(len(requests))) - set(together)
        for i in sorted(alone):
            if requests[i].budget > 0:
                drafts[i] = self._propose_one(requests[i])
        return drafts

    def _begin(self, r: DraftRequest) -> int:
        """Choose the round's horizon and bring the view up to date; 0 = no draft this round (a timed plain step)."""
        t0 = time.perf_counter()
        seq = self._seqs[r.seq_id]
        if seq.view is None:
            raise RuntimeError("the vericache drafter reads the target's KV cache: attach_cache was never called")
        n = seq.horizon.choose(r.budget)
        if n == 0:  # a plain step pays more this round: time it all the same
            seq.proposed, seq.draft_s, seq.proposed_at = 0, 0.0, time.perf_counter()
            return 0
        queries = None
        if seq.view.compressor.needs_queries and seq.queries:
            queries = self._queries(seq, seq.view.compressor.query_window)
        synced = seq.view.synced
        seq.view.sync(queries)
        if synced:  # the first sync copies the prompt once: not a cost of every round
            seq.horizon.record_sync(time.perf_counter() - t0)
        return n

    def _end(self, seq: _Sequence, n: int, draft_s: float) -> None:
        seq.proposed, seq.draft_s, seq.proposed_at = n, draft_s, time.perf_counter()
        self.stats["rounds"] += 1
        self.stats["drafted"] += n

    def _propose_greedy_together(self, requests: list[DraftRequest]) -> list[Draft]:
        horizons = [self._begin(r) for r in requests]
        t1 = time.perf_counter()
        live = []  # (index, sequence, horizon, the view's rows before drafting, tokens to feed, drafted)
        for i, (r, n) in enumerate(zip(requests, horizons)):
            if n:
                seq = self._seqs[r.seq_id]
                view = seq.view.cache
                pending = r.tokens[view.next_position :]  # committed tokens the view lacks (at least the anchor)
                view.reserve(view.length + len(pending) + n)
                live.append((i, seq, n, view.length, pending, []))
        drafts = [EMPTY_DRAFT] * len(requests)
        device = self.model.device
        while live:
            lengths = [len(st[4]) for st in live]
            last = torch.tensor(lengths, device=device).cumsum(0) - 1  # [B] each segment's last row
            batch = PackedBatch.build([st[1].view.cache for st in live], lengths, device)
            tokens = torch.tensor([t for st in live for t in st[4]], device=device)
            logits, _ = self.model.forward_packed(tokens, batch, last)  # [B, V]
            best = greedy(logits).tolist()
            still = []
            for (i, seq, n, base, _, out), tok in zip(live, best):
                out.append(int(tok))
                if len(out) < n:
                    still.append((i, seq, n, base, [int(tok)], out))
                    continue
                seq.view.cache.truncate(base)  # the drafted rows go: the full cache's rows replace them at the next sync
                self._end(seq, n, time.perf_counter() - t1)
                drafts[i] = Draft.chain(out)
            live = still
        return drafts

    def _propose_one(self, r: DraftRequest) -> Draft:
        n = self._begin(r)
        if n == 0:
            return EMPTY_DRAFT
        t1 = time.perf_counter()
        seq = self._seqs[r.seq_id]
        view = seq.view.cache
        base = view.length
        pending = r.tokens[view.next_position :]  # committed tokens the view lacks (at least the anchor)
        view.reserve(base + len(pending) + n + self.inner_k + 1)
        ctx = list(r.tokens)
        out: list[int] = []
        rows: list[torch.Tensor] = []
        layers = tuple(sorted(self._inner_layers))
        device = self.model.device
        while len(out) < n:
            room = n - len(out)
            inner = EMPTY_DRAFT
            if self.inner is not None and room > 1:
                inner = self.inner.propose([DraftRequest(r.seq_id, ctx, min(self.inner_k, room - 1), r.params,
                                                         r.generator)])[0]
            k = len(inner.tokens)
            logits, hidden = self.model(torch.tensor([pending + inner.tokens], device=device), cache=view,
                                        hidden_layers=layers, num_logits=k + 1)
            if not k and r.params.greedy:  # a plain step of the compressed model: no verification to run
                a, committed = 0, [int(greedy(logits[0, 0]))]
            else:
                res = verify_chain(logits[0], inner.tokens, inner.probs, r.params, self.rule, r.generator)
                a = int(res.num_accepted[0])
                committed = res.rows()[0]
                view.truncate(view.length - k + a)
            if not r.params.greedy:
                rows.append(probs_for(logits[0, : a + 1], r.params))
            out += committed
            ctx += committed
            pending = committed[-1:]
            if self.inner is not None:
                self.stats["inner_rounds"] += 1
                self.inner.accept(Verified(r.seq_id, a, committed,
                                           {l: h[0, -(k + 1):] for l, h in hidden.items()}))
        view.truncate(base)  # the drafted rows go: the full cache's rows replace them at the next sync
        out = out[:n]
        probs = torch.cat(rows)[:n] if rows else None
        self._end(seq, n, time.perf_counter() - t1)
        return Draft.chain(out, probs)

    def accept(self, result: Verified) -> None:
        seq = self._seqs[result.seq_id]
        anchor = seq.num_tokens - 1  # this round's anchor position
        if seq.proposed_at is not None:
            seq.horizon.record(seq.proposed, result.num_accepted, seq.draft_s, time.perf_counter() - seq.proposed_at)
        seq.proposed, seq.proposed_at = 0, None
        if self._query_layers and result.target_hidden:
            self._remember(seq, anchor, {k: h[: result.num_accepted + 1] for k, h in result.target_hidden.items()})
        if self.inner is not None:
            # The inner drafter heard the inner rounds; keep what the target accepted, then give it the target's
            # own rows for the anchor and the accepted tokens.
            self.inner.rollback(result.seq_id, anchor + 1)
            rows = {k: h[: result.num_accepted + 1] for k, h in result.target_hidden.items() if k in self._inner_layers}
            if rows:
                self.inner.observe(result.seq_id, anchor, rows)
            elif self._inner_layers:
                raise RuntimeError("the inner drafter needs the target's hidden states, which this round lacks")
        seq.num_tokens += len(result.committed)

    # ---- reporting ---------------------------------------------------------------------------------------
    def memory(self, seq_id: int) -> tuple[int, int]:
        """(compressed view bytes in its storage format, the full cache's committed bytes) for one sequence."""
        seq = self._seqs[seq_id]
        full = seq.view.full
        per_row = full.k[:, :1].numel() // full.max_len * full.k.element_size() * 2
        return seq.view.nbytes, full.length * per_row


def _int(options: dict[str, str], key: str, default: int) -> int:
    value = options.pop(key, None)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"vericache option {key}={value!r}: expected an integer") from None


def _check_same_architecture(target: Transformer, model: Transformer, where: str) -> None:
    for name in ARCH_FIELDS:
        a, b = getattr(target.config, name), getattr(model.config, name)
        if a != b:
            raise CheckpointError(f"{where}: {name} is {b}, the target's is {a}: vericache weights must be the "
                                  f"target's own (e.g. `verispec quantize` of it)")


COMPRESSOR_OPTIONS = ("sinks", "recent", "window", "pool", "slack", "bits", "group", "residual")


@register_drafter("vericache", structured=True)
def _build(arg: str | None, *, target: Transformer, dtype: torch.dtype, device: torch.device,
           options: dict[str, str] | None = None) -> VeriCacheDrafter:
    """`vericache`, `vericache:COMPRESSOR[:BUDGET]`, or structured: `vericache(compress=streaming, budget=256 (tokens)
    or budget_bytes=N (what that many bytes of uncompressed KV hold), draft=SPEC, inner_k=8, weights=DIR,
    horizon=adaptive|fixed, sinks=.., recent=.., bits=.., ...)`."""
    opts = dict(options or {})
    if arg:
        name, _, budget = arg.partition(":")
        opts.setdefault("compress", name)
        if budget:
            opts.setdefault("budget", budget)
    budget = _int(opts, "budget", 256)
    if "budget_bytes" in opts:  # a byte budget: the tokens whose uncompressed keys and values fit in it
        if "budget" in (options or {}) or (arg and ":" in arg):
            raise ConfigError("vericache takes budget (tokens) or budget_bytes, not both")
        cfg = target.config
        budget = budget_bytes(_int(opts, "budget_bytes", 0), cfg.num_hidden_layers, cfg.num_key_value_heads,
                              cfg.head_dim, 4 if target.device.type == "cpu" else torch.finfo(dtype).bits // 8)
    compressor = {"name": opts.pop("compress", "streaming"), "budget": budget}
    for key in COMPRESSOR_OPTIONS:
        if key in opts:
            compressor[key] = opts.pop(key)
    make_compressor(compressor["name"], compressor["budget"],
                    **{k: v for k, v in compressor.items() if k not in ("name", "budget")})  # fail early
    horizon = opts.pop("horizon", "adaptive")
    if horizon not in ("adaptive", "fixed"):
        raise ConfigError(f"vericache horizon={horizon!r}: expected adaptive or fixed")
    inner_k = _int(opts, "inner_k", 8)
    inner_spec, weights = opts.pop("draft", None), opts.pop("weights", None)
    if opts:
        raise ConfigError(f"vericache takes no option {sorted(opts)[0]!r}; options: compress, budget, budget_bytes, "
                          f"draft, inner_k, weights, horizon, {', '.join(COMPRESSOR_OPTIONS)}")
    model = target
    if weights is not None:
        model = load_model(weights, dtype=dtype, device=device)
        _check_same_architecture(target, model, weights)
    inner = None
    if inner_spec is not None:
        if inner_spec.partition(":")[0].partition("(")[0].strip() == "vericache":
            raise ConfigError("vericache cannot draft for itself (draft=vericache...)")
        inner = build_drafter(inner_spec, target=target, dtype=dtype, device=device)
        if inner.capabilities.reads_target_kv:
            raise ConfigError(f"vericache draft={inner_spec}: the inner drafter reads the target's KV cache, which "
                              f"only the outer drafter is lent (a compressed-KV drafter cannot nest inside one)")
        if inner.capabilities.trees:
            raise ConfigError(f"vericache draft={inner_spec}: the inner drafter proposes trees, and the compressed "
                              f"model verifies chains; use it with tree=off inside vericache")
    return VeriCacheDrafter(model, compressor, inner, inner_k, adaptive=horizon == "adaptive")
