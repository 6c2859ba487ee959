"""The serving engine: continuous batching, one target forward per step over every running request.

A step: grow running requests' caches for their next round, preempting the newest while the KV pool is short
-> admit waiting requests while the pool allows -> draft for every decoding request (one `propose` call per
drafter) -> the policy picks how many draft tokens of each request to verify -> one packed
forward over every request's pending tokens (prefill chunks, anchors, drafts) -> verify -> commit (caches,
drafters, stop checks) -> emit. Per request this is the reference loop (`decode.py`) with the same draws in the
same order, so its output equals `decode`'s whatever else is in the batch.

Chain and tree drafts share a step: a tree's segment of the packed forward carries its own positions and tree mask
(round.tree_inputs), and its cache keeps the accepted path (round.keep_accepted); the native forward runs a tree's
rows as a tree (model.fused), so a node gets a one-token step's logits. Verification (round.verify_batch): greedy
chains in one batched call, sampled trees in one per kind of q, greedy trees and sampled chains one by one. The
dspark policy cuts chains to a prefix and trees to a subtree (policies.dspark_cut: per node budgets over the step).

The draft gate (gate.py) decides per step whether dspark requests draft at all. While it keeps them plain, a drafter
whose context may have gaps (`Capabilities.context_gaps`, a windowed block drafter) is handed no hidden rows; only
the latest anchors' rows are kept (`Request.resume_rows`, at most RESUME_ROWS), and its context goes on from them
when drafting resumes: without a gap where the stretch was no longer, restarted at the first kept row where it was.

KV on demand: a request's cache starts at its prompt plus one draft round and grows by `kv_block` positions;
the pool (`cache_budget_tokens`) is the sum of what running caches hold. When it runs short the newest running
request is preempted (recompute, as vLLM does by default): its cache and its drafter's state are freed, it
returns to the head of the queue, and on readmission its committed tokens (prompt and output) are prefilled again
and its drafter restarted from them. Its stop checker, sampling generator and statistics carry over, so its
output is the one it would have had (tests/test_preemption.py).

`add_request` and `abort` may be called from any thread; `step` runs on one thread only (the forwards switch a
process-wide oneDNN flag).
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

import torch

from verispec.cache import KVCache, PackedBatch
from verispec.config import EngineConfig, RequestSpec, SamplingParams
from verispec.decode import GenerationResult, validate_prompt
from verispec.drafters.base import EMPTY_DRAFT, Draft, Drafter, DraftRequest, Verified, build_drafter
from verispec.engine.gate import DraftGate
from verispec.engine.prefix import PrefixCache
from verispec.engine.request import Request, RequestOutput
from verispec.errors import ConfigError, QueueFull
from verispec.metrics import SpecStats
from verispec.model.tokenizer import Tokenizer
from verispec.model.transformer import Transformer
from verispec.policies import AcceptanceEstimator, conditional, dspark_cut, expected_tokens, learn_from_proposals
from verispec.profile import StepProfile, load_or_measure
from verispec.round import (Verdict, accepted_rows, check_draft, keep_accepted, lend_cache, tree_inputs,
                            verify_batch)
from verispec.sampling import make_generator
from verispec.stopping import StopChecker
from verispec.threads import release_openmp_threads


@dataclass
class EngineMetrics(SpecStats):
    """Engine-wide counters: the speculation counters of SpecStats summed over every request (vLLM's names),
    plus admission and step counts."""

    prompt_tokens: int = 0
    num_steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    rejected: int = 0  # refused at admission (queue full)
    preemptions: int = 0  # running requests whose cache was freed for older ones (recomputed on readmission)
    recomputed_tokens: int = 0  # committed tokens prefilled again after preemptions
    undrafted_steps: int = 0  # steps with dspark requests that drafted nothing: drafting did not pay at that load
    peak_kv_tokens: int = 0  # the most KV positions running caches held at once (a bench may reset it)

    @property
    def generation_tokens(self) -> int:
        return self.num_output_tokens


@dataclass
class _Round:
    """One decoding request's part of a step."""

    req: Request
    draft: Draft
    rows: int = 0  # first logit row of this request in the step's logits
    proposed: list[int] = field(default_factory=list)  # the whole draft, before the policy cut it
    gap: bool = False  # kept plain by the draft gate, its drafter takes gaps: no rows handed over (see _run_step)
    cold: bool = False  # asked to propose where its last step was not: its drafter's context is behind (_draft)


class Engine:
    # Anchor rows a request keeps while the gate holds it plain (its drafter taking gaps), for drafting to resume on.
    # Resumed on its latest anchor alone, the DSpark drafter committed 2.7 and 2.8 tokens in its first two rounds
    # against 4.4 from the third on (one request, 16 plain steps then 8 drafted, Zen 4): a probe of drafting read it
    # ~35% below what it earns, and the gate kept plain where drafting paid 1.3-1.5x.
    RESUME_ROWS = 16

    def __init__(
        self,
        target: Transformer,
        tokenizer: Tokenizer | None = None,
        config: EngineConfig = EngineConfig(),
        *,
        drafters: dict[str, Drafter] | None = None,
        profile: StepProfile | Callable[[], StepProfile] | None = None,
        context_limit: int | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.config = config
        self.limit = min(context_limit or target.config.context_limit, target.config.context_limit)
        self.eos = tokenizer.eos_token_ids if tokenizer and tokenizer.eos_token_ids else target.config.eos_token_id
        self._drafters: dict[str, Drafter] = dict(drafters or {})
        self._profile = profile
        self.estimator = AcceptanceEstimator(max_k=max(config.k, 16))
        self._draft_s = 0.0  # moving average of a drafting step's time (seconds)
        self._step_t0 = 0.0  # when the current step began (the draft gate times whole steps)
        self.gate = DraftGate()  # whether steps draft for dspark requests at all, per load
        self.prefix = (PrefixCache(config.prefix_cache_bytes, config.prefix_block)
                       if config.prefix_cache_bytes else None)
        self.metrics = EngineMetrics()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.reserved_tokens = 0  # KV positions the running requests' caches hold (the pool in use)
        self._inbox: deque[tuple[str, object]] = deque()  # ("add", Request) | ("abort", request_id)
        self._lock = threading.Lock()
        self._queued = 0  # requests added but not yet admitted (inbox adds + waiting)
        self._seq_ids = itertools.count()
        self._ids = itertools.count()
        # seq_id -> every Request object not yet collected (weakly: the check in check_idle)
        self._alive: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
        # Called once per step with all of that step's outputs (one hand-over per step, not one per request).
        self.on_outputs: Callable[[list[RequestOutput]], None] | None = None
        # The thread that runs `step` (AsyncEngine's loop thread; else the first to call it). A drafter built on
        # another thread (add_request validates its spec) frees that thread's OpenMP workers afterwards.
        self.step_thread: threading.Thread | None = None

    # ---- requests in and out (any thread) -------------------------------------------------------------------
    def add_request(
        self,
        prompt: list[int],
        params: SamplingParams = SamplingParams(),
        spec: RequestSpec = RequestSpec(),
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises ConfigError for a request that can never run and QueueFull when the queue is."""
        validate_prompt(prompt, self.target.config.vocab_size, self.limit)
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer")
        drafter, policy, k = self._resolve(spec)
        if drafter is not None:
            caps = self.drafter(drafter).capabilities  # fail now, not inside a step, if the spec is bad
            if spec.tree is not None and spec.tree.enabled and not (caps.trees or caps.tree_requests):
                raise ConfigError(f"drafter {drafter!r} drafts chains only; a tree needs model, eagle, mtp, medusa, "
                                  "dspark or block (not an RNN head)")
        max_positions = min(self.limit, len(prompt) + params.max_tokens + k + 1)
        if max_positions > self.config.cache_budget_tokens:
            raise ConfigError(
                f"the request needs {max_positions} KV cache positions (prompt {len(prompt)} + max_tokens "
                f"{params.max_tokens} + draft {k + 1}); the engine's cache budget is {self.config.cache_budget_tokens}"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(
            request_id=rid, seq_id=next(self._seq_ids), prompt=list(prompt), params=params, drafter=drafter,
            policy=policy, k=k, verify=spec.verify, max_positions=max_positions, arrival=time.perf_counter(),
            stopper=StopChecker(params, len(prompt), self.limit, self.eos, self.tokenizer, prompt),
            generator=None if params.greedy else make_generator(params.seed, self.target.device),
            tokens=list(prompt), tree=spec.tree,
        )
        self._alive[req.seq_id] = req
        with self._lock:
            if self._queued >= self.config.max_queued:
                self.metrics.rejected += 1
                raise QueueFull(f"the queue is full ({self.config.max_queued} waiting requests); retry later")
            self._queued += 1
            self._inbox.append(("add", req))
        return rid

    def _resolve(self, spec: RequestSpec) -> tuple[str | None, str, int]:
        """A request's drafter spec, policy and k, the engine's defaults filling what it leaves open."""
        drafter = self.config.drafter if spec.drafter is None else spec.drafter
        drafter = None if drafter in (None, "", "none") else drafter
        policy = spec.policy or self.config.policy
        k = self.config.k if spec.k is None else spec.k
        if drafter is None or k == 0:
            return drafter, "off", 0
        return drafter, policy, k

    def draft_slots(self, spec: RequestSpec) -> int:
        """KV positions a request reserves beside prompt + max_tokens: its k draft tokens and the bonus token."""
        return self._resolve(spec)[2] + 1

    def abort(self, request_id: str) -> None:
        """Abort a waiting or running request (idempotent); its cache is freed at the next step."""
        with self._lock:
            self._inbox.append(("abort", request_id))

    @property
    def num_waiting(self) -> int:
        return self._queued

    def has_unfinished(self) -> bool:
        return bool(self.running or self._queued or self._inbox)

    # ---- drafters and profile ------------------------------------------------------------------------------
    def drafter(self, spec: str) -> Drafter:
        if spec not in self._drafters:
            drafter = build_drafter(spec, target=self.target, dtype=self.target.dtype, device=self.target.device)
            self._drafters[spec] = drafter
            if self.step_thread is not None and threading.current_thread() is not self.step_thread:
                # Its parallel regions left workers on this thread: with the step thread's, more than the CPUs,
                # and libgomp's workers then sleep between regions (a dspark step's forward 2.3x slower, Zen 5).
                release_openmp_threads()
        return self._drafters[spec]

    @property
    def profile(self) -> StepProfile:
        if not isinstance(self._profile, StepProfile):
            self._profile = self._profile() if callable(self._profile) else load_or_measure(self.target)
        return self._profile

    # ---- the step (one thread) -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.step_thread = self.step_thread or threading.current_thread()
        # The draft gate times the whole step: growing caches for the next round (_grow) is part of what a step's
        # tokens cost, more so when it drafts (0.27 ms of a 7.1 ms drafted step at 4 requests, 0.04 of a 2.0 ms
        # plain one, Zen 5); timed from the drafting on, drafting's rate read 5% high.
        self._step_t0 = time.perf_counter()
        outputs: list[RequestOutput] = []
        self._drain_inbox(outputs)
        self._grow()
        self._admit()
        self.metrics.peak_kv_tokens = max(self.metrics.peak_kv_tokens, self.reserved_tokens)
        if self.running:
            with torch.inference_mode():
                self._run_step(outputs)
            self.metrics.num_steps += 1
        if self.on_outputs is not None and outputs:
            self.on_outputs(outputs)
        return outputs

    def run_until_done(self) -> dict[str, GenerationResult]:
        results = {}
        while self.has_unfinished():
            for out in self.step():
                if out.result is not None:
                    results[out.request_id] = out.result
        return results

    def _drain_inbox(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            commands = list(self._inbox)
            self._inbox.clear()
        for kind, payload in commands:
            if kind == "add":
                self.waiting.append(payload)
            else:
                self._abort_now(str(payload), outputs)

    def _abort_now(self, request_id: str, outputs: list[RequestOutput]) -> None:
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                outputs.append(self._finish(req, "abort", None, []))
                with self._lock:  # after the finish is counted (see _finish)
                    self._queued -= 1
                return
        for req in self.running:
            if req.request_id == request_id:
                outputs.append(self._finish(req, "abort", None, []))
                return

    def _capacity(self, req: Request, need: int) -> int:
        """Cache positions to hold `need`: whole KV blocks, never more than the request can ever use."""
        block = self.config.kv_block
        return min(req.max_positions, -(-need // block) * block)

    def _next_round(self, req: Request) -> int:
        """Positions the request's next forward may fill: its committed tokens and a full draft."""
        return min(req.max_positions, len(req.tokens) + req.k + 1)

    def _admit(self) -> None:
        # First come, first served: the head waits until it fits, so large requests do not starve. It also leaves
        # each running request its next block to grow into, so that admitting it does not preempt it at once.
        block = self.config.kv_block
        headroom = sum(min(block, r.max_positions - r.cache.max_len) for r in self.running)
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            size = self._capacity(req, self._next_round(req))
            if self.reserved_tokens + size + headroom > self.config.cache_budget_tokens:
                return
            self.waiting.popleft()
            req.cache = KVCache.for_model(self.target, max_len=size, tier=self.config.kv_tier)
            layers = self._prefix_layers(req)
            # the prefill then starts after the rows it found; a drafter restarting its context there needs at least
            # one prompt row before the anchor to restart it at
            restarts = req.drafter is not None and layers == () and bool(
                self.drafter(req.drafter).capabilities.hidden_layers)
            hit, hidden = self.prefix.load(req.prompt, req.cache, layers, 2 if restarts else 1) if (
                layers is not None) else (0, {})
            self.reserved_tokens += size
            headroom += min(block, req.max_positions - size)
            if req.preemptions:
                self.metrics.recomputed_tokens += len(req.tokens) - req.cache.length
            else:
                self.metrics.prompt_tokens += len(req.prompt)
            if req.drafter is not None:
                self.drafter(req.drafter).start(req.seq_id, req.tokens)
                lend_cache(self.drafter(req.drafter), req.seq_id, req.cache)
                if hit and hidden:  # what the prefill of those rows would have shown it
                    self.drafter(req.drafter).observe(req.seq_id, 0, hidden)
            self.running.append(req)
            with self._lock:  # only now: has_unfinished() never sees the request in neither place
                self._queued -= 1

    def _grow(self) -> None:
        """Room in every running cache for its next round, oldest request first; while the pool is short, the
        newest running request is preempted (possibly the one that needed the room)."""
        budget = self.config.cache_budget_tokens
        for req in sorted(self.running, key=lambda r: r.arrival):
            need = self._next_round(req)
            if req.cache is None or req.cache.max_len >= need:
                continue  # preempted for an older request already, or room enough
            size = self._capacity(req, need)
            while self.reserved_tokens + size - req.cache.max_len > budget:
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                if victim is req:
                    break
            else:
                self.reserved_tokens += size - req.cache.max_len
                req.cache.resize(size)

    def _preempt(self, req: Request) -> None:
        """Free a running request's cache and drafter state and queue it first again (recomputed on readmission)."""
        with self._lock:  # counted as queued before it leaves `running`: has_unfinished() never misses it
            self._queued += 1
        self.waiting.appendleft(req)
        self.reserved_tokens -= req.cache.max_len
        if req.drafter is not None:
            self.drafter(req.drafter).finish(req.seq_id)
        self.running.remove(req)
        req.cache = None
        req.prompt_hidden.clear()
        req.resume_rows.clear()
        req.drafted_last = False  # its drafter starts over on readmission
        req.preemptions += 1
        self.metrics.preemptions += 1

    def _finish(
        self, req: Request, reason: str, stop_reason: str | int | None, token_ids: list[int], text: str = ""
    ) -> RequestOutput:
        # Bookkeeping first, leaving `running` last: another thread that sees has_unfinished() turn False (the
        # async front, tests polling it) must also see the finish counted and the reservation returned.
        self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
        self.estimator.forget(req.request_id)
        if req in self.running:
            self.reserved_tokens -= req.cache.max_len
            if req.drafter is not None:
                self.drafter(req.drafter).finish(req.seq_id)
            self.running.remove(req)
        req.cache = None  # give the memory back now
        req.stats.elapsed_s = time.perf_counter() - req.arrival
        result = GenerationResult(
            prompt_token_ids=list(req.prompt), token_ids=list(req.stopper.output),
            text=req.stopper.text if self.tokenizer is not None else None, finish_reason=reason,
            stop_reason=stop_reason, stats=req.stats,
        )
        return RequestOutput(req.request_id, token_ids, text, result)

    def _reads_prompt(self, req: Request) -> bool:
        """Whether the request's drafter reads what the target's forward computes for the context (its hidden
        states or the KV as written), so that it cannot draft in the step that computes them."""
        if req.drafter is None:
            return False
        needs = self.drafter(req.drafter).capabilities
        return bool(needs.hidden_layers) or needs.reads_target_kv

    def _prefix_layers(self, req: Request) -> tuple[int, ...] | None:
        """The hidden layers a prefix-cache hit must bring along for this request's drafter; None where it takes
        no hits (no prefix cache, a tiered cache, or a drafter reading the target's KV as written). A drafter whose
        context may have gaps (a windowed block drafter) needs none: its context restarts at the first row the
        prefill computes, so it takes the blocks plain requests store (KV only: the hidden states made each block
        19 KB a row instead of 16 on the zoo target, and a dspark engine prefilled 1.7x the rows a plain one did
        under the same cyclic load, 0.81x its tokens/s at 8 clients with the gate keeping it plain), and its τ is
        flat in its context length down to a few rows (engine/gate.py's restarts measured it)."""
        if self.prefix is None or not self.prefix.takes(req.cache):
            return None
        if req.drafter is None:
            return ()
        needs = self.drafter(req.drafter).capabilities
        if needs.reads_target_kv:
            return None
        return () if needs.context_gaps else tuple(needs.hidden_layers)

    def _budget(self, req: Request, num_decoding: int) -> int:
        """The most draft tokens this request may propose this step (never past max_tokens or the context)."""
        # dspark drafts at most two past what it verified last round: drafting positions the scheduler is sure to
        # cut costs a draft model real forwards (the production variant sizes the budget from earlier steps too).
        # A drafter that proposes every position in one forward is asked for k, as the library's dspark policy
        # asks: the cap saves it little. With the DSpark drafter, uncapped over capped at 1 / 2 closed-loop clients
        # 1.04 / 1.07x, 1.02 / 1.05x and, over 10 repeats, 1.03 / 0.99x (medians, scripts/engine_ab.py, Zen 5).
        if req.policy == "dspark":
            one_pass = self.drafter(req.drafter).capabilities.one_pass
            k = req.k if one_pass else min(req.k, req.last_verified + 2)
        else:
            k = {"off": 0, "fixed": req.k, "batch-table": min(req.k, self.config.table_k(num_decoding))}[req.policy]
        n = len(req.tokens)
        return max(0, min(k, req.params.max_tokens - len(req.stopper.output) - 1, self.limit - n - 1))

    def _run_step(self, outputs: list[RequestOutput]) -> None:
        # Who decodes this step: everyone whose uncached prompt fits in what is left of the prefill chunk.
        chunk_left = self.config.prefill_chunk
        decoding: list[Request] = []
        prefill: list[tuple[Request, int]] = []  # (request, prompt tokens to prefill only)
        for req in self.running:
            todo = len(req.pending) - 1  # tokens before the anchor
            if req.recomputing and self._reads_prompt(req):
                # Prefill only, up to the anchor: a round riding along would draft nothing (its drafter reads
                # the context this forward computes) and take draws the request never took unpreempted.
                if chunk_left > 0:
                    prefill.append((req, min(todo, chunk_left)))
                    chunk_left -= min(todo, chunk_left)
                continue
            if todo <= chunk_left:
                chunk_left -= todo
                decoding.append(req)
            elif chunk_left > 0:
                prefill.append((req, chunk_left))
                chunk_left = 0
        for req in self.running:  # tiered caches start their copy-in while the drafters run
            req.cache.prefetch()
        t0 = time.perf_counter()
        gated = any(r.policy == "dspark" and r.drafter is not None for r in decoding)
        clean = not prefill and all(len(r.pending) == 1 for r in decoding)  # no prompt rides along: measurable
        peak = self.gate.peak(len(decoding) + len(prefill))  # the recent steps' most requests (gate.py)
        drafting = not gated or self.gate.draft(len(decoding), clean, peak)
        self.metrics.undrafted_steps += not drafting
        emitted_before = self.metrics.num_output_tokens
        rounds = self._draft(decoding, dspark=drafting)
        # For the draft gate (gate.py): a step drafted only where a dspark request proposed tokens (a round at its
        # request's last token has no budget: a plain step), measured only where no request drafted cold (a request
        # under another policy catching up on its prompt makes a plain step slow too).
        warm = not any(r.cold for r in rounds)
        gate_drafted = drafting and any(r.req.policy == "dspark" and r.draft.tokens for r in rounds)
        if not drafting:  # the gate kept them plain: a drafter whose context may have gaps gets no rows
            for rnd in rounds:
                rnd.gap = rnd.req.policy == "dspark" and rnd.req.drafter is not None and self.drafter(
                    rnd.req.drafter).capabilities.context_gaps
        elapsed = time.perf_counter() - t0
        if any(r.draft.tokens for r in rounds):  # the drafters' cost per drafting step, for the dspark rule
            self._draft_s = elapsed if not self._draft_s else 0.8 * self._draft_s + 0.2 * elapsed
        self._schedule(rounds, prefill_tokens=sum(n for _, n in prefill))
        # what the verified drafts commit on average, for the gate: steadier than what they commit (gate.py)
        expected = sum(expected_tokens(r.draft, self._conditional(r)) for r in rounds) if (
            gate_drafted and clean) else None

        # One packed forward: [prefill chunks] then per decoding request [pending..., draft...].
        caches, lengths, tokens, logit_rows, trees = [], [], [], [], []
        device = self.target.device
        observed: list[tuple[Request, int, int, int]] = []  # prompt rows drafters must see: (req, pos, row, n)
        for req, n in prefill:
            observed.append((req, req.cache.length, len(tokens), n))
            caches.append(req.cache)
            lengths.append(n)
            trees.append(None)
            tokens.extend(req.pending[:n])
        for rnd in rounds:
            seg = rnd.req.pending + rnd.draft.tokens
            if len(rnd.req.pending) > 1:  # the rest of the prompt rides along with the first round
                observed.append((rnd.req, rnd.req.cache.length, len(tokens), len(rnd.req.pending) - 1))
            caches.append(rnd.req.cache)
            lengths.append(len(seg))
            trees.append(tree_inputs(rnd.draft, rnd.req.cache, len(rnd.req.pending), device))
            first = len(tokens) + len(seg) - len(rnd.draft.tokens) - 1  # the anchor's row
            rnd.rows = len(logit_rows)
            logit_rows.extend(range(first, first + len(rnd.draft.tokens) + 1))
            tokens.extend(seg)
        users = [r for r in self.running if r.drafter is not None]
        hidden_layers = sorted({layer for r in users for layer in self.drafter(r.drafter).capabilities.hidden_layers})
        with ExitStack() as resident:
            for c in caches:
                resident.enter_context(c.resident())
            batch = PackedBatch.build(caches, lengths, device, trees if any(t is not None for t in trees) else None)
            logits, hidden = self.target.forward_packed(
                torch.tensor(tokens, device=device), batch, torch.tensor(logit_rows, dtype=torch.long, device=device),
                hidden_layers,
            )
        for req, pos, row, n in observed:
            if req.drafter is not None and hidden:
                rows = {k: h[row : row + n] for k, h in hidden.items()}
                self.drafter(req.drafter).observe(req.seq_id, pos, rows)
                if req.stats.num_rounds == 0 and self._prefix_layers(req):  # for the prefix cache (_commit)
                    req.prompt_hidden.append((pos, {k: h.clone() for k, h in rows.items()}))
        verdicts = self._verify(rounds, logits)
        self._keep_resume_rows([rnd for rnd in rounds if rnd.gap], hidden, logit_rows)
        for rnd, verdict, rows in zip(rounds, verdicts, self._kept_rows(rounds, verdicts, hidden, logit_rows)):
            self._commit(rnd, verdict, rows, outputs)
        if gated and clean:  # a step that also prefilled pays mostly for the prompt
            self.gate.record(len(decoding), gate_drafted, self.metrics.num_output_tokens - emitted_before,
                             time.perf_counter() - self._step_t0, counted=warm, expected=expected)

    def _keep_resume_rows(self, gaps: list[_Round], hidden: dict[int, torch.Tensor], logit_rows: list[int]) -> None:
        """Rounds the gate kept plain whose drafter takes gaps keep their anchor's row, the latest RESUME_ROWS of
        them, so that drafting resumes on a context of recent positions rather than one row. A request keeps
        (position, the step's hidden states, its row there): a reference, sliced only if drafting resumes. (A gather
        a step cost 15 us at 4 requests, ~0.5% of a step, and slicing per request 29 us; the forward's hidden
        tensors are fresh each step, so at most RESUME_ROWS steps' stay alive.)"""
        if not hidden:
            return
        for rnd in gaps:
            kept = rnd.req.resume_rows
            kept.append((len(rnd.req.tokens) - 1, hidden, logit_rows[rnd.rows]))
            if len(kept) > self.RESUME_ROWS:
                del kept[0]

    @staticmethod
    def _resume(kept: list[tuple[int, dict[int, torch.Tensor], int]]) -> tuple[int, dict[int, torch.Tensor]]:
        """The kept rows' latest run of consecutive positions: its first position and {layer: [n, d]}."""
        first = len(kept) - 1
        while first > 0 and kept[first - 1][0] == kept[first][0] - 1:
            first -= 1
        run = kept[first:]
        return run[0][0], {k: torch.stack([rows[k][i] for _, rows, i in run]) for k in run[0][1]}

    def _draft(self, decoding: list[Request], dspark: bool = True) -> list[_Round]:
        """Each decoding request's draft (EMPTY_DRAFT when it drafts nothing); `dspark=False`: the gate found that
        drafting does not pay at this load, so requests under the dspark policy take a plain step."""
        rounds = {req.request_id: _Round(req, EMPTY_DRAFT) for req in decoding}
        by_drafter: dict[str, list[DraftRequest]] = {}
        for req in decoding:
            drafts = dspark or req.policy != "dspark"
            if drafts and req.resume_rows:  # the gate kept it plain before: its context goes on from the rows kept
                pos, rows = self._resume(req.resume_rows)
                req.resume_rows.clear()
                self.drafter(req.drafter).observe(req.seq_id, pos, rows)
            budget = self._budget(req, len(decoding)) if drafts else 0
            if len(req.pending) > 1 and self._reads_prompt(req):
                budget = 0  # its context (the prompt's hidden states or KV rows) arrives with this very forward
            asked = req.drafter is not None and budget > 0
            if asked:
                by_drafter.setdefault(req.drafter, []).append(
                    DraftRequest(req.seq_id, req.tokens, budget, req.params, req.generator, req.tree))
            # Cold: asked after a step that did not ask it (its drafter has a plain stretch or the prompt to catch
            # up), not after one where it proposed nothing (prompt lookup without a match has nothing to catch up).
            rounds[req.request_id].cold = asked and not req.drafted_last
            req.drafted_last = asked
        by_seq = {req.seq_id: req for req in decoding}
        for spec, batch in by_drafter.items():
            drafter = self.drafter(spec)
            for dreq, draft in zip(batch, drafter.propose(batch)):
                check_draft(draft, dreq.budget, self.target.config.vocab_size, drafter)
                # the acceptance estimator scores whole chain proposals; a tree's nodes are no positions
                proposed = draft.tokens if draft.is_chain else []
                rid = by_seq[dreq.seq_id].request_id
                rounds[rid] = replace(rounds[rid], draft=draft, proposed=proposed)
        return list(rounds.values())

    def _conditional(self, rnd: _Round) -> list[float]:
        return conditional(rnd.draft, self.estimator, rnd.req.drafter or "", rnd.req.request_id)

    def _schedule(self, rounds: list[_Round], prefill_tokens: int) -> None:
        """Cut each draft to what its policy verifies (dspark: Algorithm 1 over every node of all dspark requests'
        drafts: a chain to a prefix, a tree to a subtree)."""
        sched = [r for r in rounds if r.req.policy == "dspark" and r.draft.tokens]
        if not sched:
            return
        fixed = [(r.draft, self._conditional(r)) for r in rounds if r not in sched]
        requests = len(rounds) + (1 if prefill_tokens else 0)
        prof, draft_s = self.profile, self._draft_s
        # A step's time is the drafting it already spent plus the target's forward: what the tokens it commits cost,
        # at the context its requests attend to (attention's share grows with it).
        context = sum(len(r.req.tokens) for r in rounds) / len(rounds)
        cut = dspark_cut([r.draft for r in sched], [self._conditional(r) for r in sched], fixed, prefill_tokens,
                         lambda b: draft_s + prof.step_time(b, requests, context))
        for rnd, draft in zip(sched, cut):
            rnd.req.last_verified = len(draft.tokens)
            rnd.draft = draft

    def _verify(self, rounds: list[_Round], logits: torch.Tensor) -> list[Verdict]:
        """Verdicts per round (round.verify_batch: each round's rows follow the previous round's)."""
        return verify_batch(logits, [r.draft for r in rounds], [r.req.params for r in rounds],
                            [r.req.verify for r in rounds], [r.req.generator for r in rounds])

    @staticmethod
    def _kept_rows(
        rounds: list[_Round], verdicts: list[Verdict], hidden: dict[int, torch.Tensor],  # {layer: [N, d]} the step's
        logit_rows: list[int],
    ) -> list[dict[int, torch.Tensor]]:  # per round {layer: [accepted + 1, d]} ({} without a drafter)
        """Each drafting request's anchor and accepted rows of the target's hidden states (round.accepted_rows),
        gathered once per layer into one compact copy whose slices the drafters keep: no view of the step's whole
        outputs stays alive, and no request pays a copy of its own (3 copies a request a step were ~2% of a
        32-request step: /tmp carry A/B in the session note of stop 33)."""
        index: list[int] = []
        spans: list[tuple[int, int] | None] = []
        for rnd, verdict in zip(rounds, verdicts):
            if rnd.req.drafter is None or rnd.gap or not hidden:
                spans.append(None)
                continue
            first, rows = logit_rows[rnd.rows], accepted_rows(verdict)
            spans.append((len(index), len(index) + len(rows)))
            index += [first + j for j in rows]
        if not index:
            return [{}] * len(rounds)
        at = torch.tensor(index, device=next(iter(hidden.values())).device)
        compact = {layer: h[at] for layer, h in hidden.items()}
        return [{} if span is None else {layer: c[span[0] : span[1]] for layer, c in compact.items()}
                for span in spans]

    def _commit(
        self, rnd: _Round, verdict: Verdict, req_hidden: dict[int, torch.Tensor],  # {layer: [accepted + 1, d]}
        outputs: list[RequestOutput],
    ) -> None:
        req = rnd.req
        k = len(rnd.draft.tokens)
        num_accepted = verdict.num_accepted
        n = len(req.tokens)
        keep_accepted(req.cache, rnd.draft, verdict, n)  # the anchor and the accepted path stay; the rest goes
        emitted = req.stopper.extend(verdict.tokens)
        req.tokens.extend(emitted.token_ids)
        req.stats.record_round(k, num_accepted, len(emitted.token_ids), rnd.draft.depth)
        self.metrics.record_round(k, num_accepted, len(emitted.token_ids), rnd.draft.depth)
        if req.stats.num_rounds == 1:
            req.stats.ttft_s = time.perf_counter() - req.arrival
            if self.prefix is not None and self.prefix.takes(req.cache):  # the whole prompt is in the cache now
                chunks, req.prompt_hidden = req.prompt_hidden, []
                rows = {k: torch.cat([c[k] for _, c in chunks]) for k in chunks[0][1]} if chunks else None
                self.prefix.store(req.prompt, req.cache, rows, chunks[0][0] if chunks else 0)
        if rnd.proposed:
            req.shadow.append((n, rnd.proposed, rnd.draft.kind))  # a cut draft keeps its proposal's kind
        self._learn_acceptance(req)
        if req.drafter is not None and not rnd.gap:  # every round, drafted or not, as the reference loop does
            self.drafter(req.drafter).accept(Verified(req.seq_id, num_accepted, emitted.token_ids, req_hidden))
        if emitted.finish_reason is None:
            outputs.append(RequestOutput(req.request_id, emitted.token_ids, emitted.text))
        else:
            outputs.append(self._finish(req, emitted.finish_reason, emitted.stop_reason, emitted.token_ids,
                                        emitted.text))

    def _learn_acceptance(self, req: Request) -> None:
        learn_from_proposals(self.estimator, req.drafter or "", req.request_id, req.shadow, req.tokens)

    # ---- introspection -------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Debug check: caches hold exactly the committed tokens but the anchor; reservations add up."""
        assert self.reserved_tokens == sum(r.cache.max_len for r in self.running), "reserved tokens out of sync"
        assert self.reserved_tokens <= self.config.cache_budget_tokens, "over the cache budget"
        for r in self.running:
            assert r.cache is not None and r.cache.length <= len(r.tokens) - 1, f"{r.request_id}: cache overrun"
            assert r.cache.max_len <= r.max_positions, f"{r.request_id}: cache larger than it can use"
        for r in self.waiting:
            assert r.cache is None, f"{r.request_id}: a waiting request holds a cache"

    def check_idle(self) -> None:
        """Assert that an engine with nothing to do holds nothing of any request: no queued, waiting or running
        request, no reserved KV positions, no per-request acceptance estimate, no drafter sequence state, and no
        Request object (its cache, generator, stop checker) alive anywhere in the process. Call it from the
        thread that runs `step`, or while that thread waits for work."""
        problems = []
        with self._lock:
            if self._inbox or self._queued:
                problems.append(f"inbox {len(self._inbox)}, queued {self._queued}")
        if self.waiting or self.running:
            problems.append(f"waiting {len(self.waiting)}, running {len(self.running)}")
        if self.reserved_tokens:
            problems.append(f"reserved_tokens {self.reserved_tokens}")
        if self.estimator.tracked():
            problems.append(f"acceptance estimates kept for {sorted(self.estimator.tracked())[:5]}")
        for spec, drafter in self._drafters.items():
            if drafter.live_sequences():
                problems.append(f"drafter {spec!r} holds state for sequences {sorted(drafter.live_sequences())[:5]}")
        if len(self._alive):  # a cycle may hold a finished request until the collector runs
            gc.collect()
            alive = [r.request_id for r in list(self._alive.values())]
            if alive:
                problems.append(f"{len(alive)} Request objects still referenced: {alive[:5]}")
        if problems:
            raise AssertionError("engine not idle: " + "; ".join(problems))
