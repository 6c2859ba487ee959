"""Whether a step drafts for the dspark policy at all, from what drafting steps and plain steps delivered.

The dspark cut (policies.dspark_cut) decides how much of a draft to verify once it exists, with the drafting time
already spent. Under load that time is the problem: a drafter proposes for every request each step, and when most
drafts are cut anyway, the step is slower than plain (measured through the server: 8-64 clients, dspark 0.7x
plain's aggregate). The gate compares committed tokens per second of recent steps that drafted and of steps that
did not, per load (the number of decoding requests, in powers of two), and drafts only where drafting has paid;
the other choice is retried now and then so that a change of load, text or acceptance shows: every `probe_every`
steps, or more rarely when it costs more, so that probing costs at most `probe_cost` of the time, and rarer still
(up to `max_backoff` times) while probes keep confirming the choice; a heavier load that a lighter one keeps plain
then learns that drafting pays again up to that many times later. A probe's cost is
the time it takes beyond what the better choice would have taken for the same tokens, against the better choice's
step time: a drafted step at 64 requests took 173 ms for ~190 tokens where plain steps made 2,400 tokens/s in 23
ms (a 93 ms loss: probed every 81 steps, not every 24 as a spacing by the ratio of the rates gave, which let 7% of
the steps take 19% of the time; every 163 now that a probe of drafting counts as two steps, see below).

Drafting pays less the more requests share a step (each verified token costs real compute once the step is
compute-bound), so a load heavier than one where drafting measured slower does not draft at all, not even to probe:
the lighter load's probes find out when drafting pays again (the DSpark drafter alone took 83 ms a step at 32
requests against a 9.7 ms plain step, README; the warm-up, first measurement and probes at 32 clients were 8 of 319
steps in serve-compare run 11). A load is not measured from scratch where the nearest load measured found drafting
slower either: it starts plain, and its first drafted step waits for that load's probe spacing. (A closed loop's
tail drains through every lighter load; measuring each by drafting first cost two drafted steps apiece, 67 ms
against a plain step's 8 at 15 requests.)

A drafted step in which some request drafts cold (its first round since it started, or since plain steps left its
drafter's context behind) is not measured either: that round builds the drafter's context (up to a window of
prompt rows) and cost 7.9 ms for 3.0 tokens at one request, against 5.1 ms for 3.6 in a round after a drafted one
(open loop at 6 req/s, Zen 4). Counted, such rounds were all the gate saw of drafting at one request in an open
loop, where one request alone has always just arrived: it read drafting at 236 tokens/s against plain's 383 where
drafting warm ran 700, and kept every heavier load plain too. The choice of a step that is not measured is taken
again at that load's next clean step (`redo`), so a probe of drafting from plain is two drafted steps, and the
spacing counts it so.

A drafted step counts at its load the tokens its verified drafts were expected to commit, not the ones they did:
the sum over its rounds of 1 + each verified node's survival (policies.expected_tokens, from the drafter's
confidences or the acceptance estimate, as the dspark cut reads them), scaled by what drafted steps at every load
committed per token expected (`calibration`). What a round commits follows its luck: at one request in an open loop
(2 req/s, the DSpark drafter, Zen 4; scripts/gate_verdict_noise.py) drafted steps committed 3.54 tokens with a
standard deviation of 2.43, against 3.34 +- 1.03 expected, and committed over expected was 1.06 at one request and
1.10 at two or three. A verdict formed from a load's first three drafted steps read that luck: in bootstrap draws of
three steps of each choice at one request, where drafting paid 1.54x, it read drafting below the margin in 26% of
draws by committed tokens and 11% by expected ones; at 2-3 requests, where the steps' times vary more, 19% and
16%. The luck now averages over every load's drafted steps. End to end it is inside the host's noise (per
user over the committed-token gate 1.02x, 1.01x, 0.93x at 2, 4, 8 req/s, medians of 6 interleaved repeats,
scripts/openloop_gate.py), and passes whose gate kept most steps plain still happen with either.

A step with fewer requests than a recent one drafts only where drafting also pays at that recent load (`peak`, over
the last `window` steps). Through the server a closed loop of 4 clients keeps one client between requests (its
reply, its next request, tokenizing) for a step or a few: those steps hold 3 requests, where the lighter bucket
(2-3) found that drafting pays, so the gate drafted them, each stretch starting cold, and the 4 clients ran at 0.90x
plain (serve-compare run 39, Zen 4) where in process, with no such gaps, it kept them plain. In one traced run 53
of 54 such gaps lasted 1-3 steps, hence a window of 4 (a gap's steps and the one before it): an open loop's load
falls for real when a request ends, and every step held plain after that is drafting forgone (in process at 2 and 6
req/s the hold took 7 of 648 and 30 of 1,254 steps). Only the decision looks back: a held step is not recorded (it
is not the gate's choice at its own load; recorded, held stretches would stand for plain's rate where drafting was
chosen), and each step is measured at its own count. Through the server at 4 clients the hold cuts the drafted
steps (1.3-3.1% against 6.2-11.2%); what that buys is inside the host's noise there: dspark over plain 0.955 and
0.939 against 0.946 and 0.933 without the hold, in two A/Bs of 16 repeats on a quiet host (scripts/gate_peak_ab.py,
Zen 4; reports/serve-compare).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DraftGate:
    probe_every: int = 16  # the most often the other choice is retried
    # The share of time probing may cost (see spacing). It is what the dspark policy loses to plain at a load where
    # drafting never pays: at 0.05, 8 clients in process lost 3-5% to probes (a drafted step 26 ms for 25 tokens,
    # plain 5.3 ms for 8); at 0.02 a probe comes every ~85 steps there (9 ms lost / (0.02 x 5.3 ms)).
    probe_cost: float = 0.02
    # Drafting must beat plain by this factor to be chosen: plain is the safe choice. Through the server at 8 clients
    # drafting runs at ~0.9x plain by the gate's own averages, near enough that noise flipped the choice without it
    # (130 of 1,038 steps drafted, 0.83x plain, Zen 5); at one client it is 1.5-1.7x, far outside it.
    margin: float = 1.1
    clip: float = 2.0  # a recorded step counts at most this many times its choice's average step time
    # Weight of the past in a choice's token and time averages, per step recorded at its load: ~50 steps of memory.
    # At one request what drafting earns follows the text (a round of 1-2 tokens at 280-550 tok/s beside rounds of
    # 9 at 2,200); with 10 steps of memory the gate chased it, went plain for a poor stretch and learnt of a good
    # one only at its next probe, losing 10-15% of drafting's speedup at one client.
    decay: float = 0.98
    # Samples a choice needs at a load before its average is trusted: until then the other choice is retried every
    # `probe_every` steps and the load sets no bound for heavier ones. One slow early sample (a drafter's first
    # shapes) kept the MTP drafter's dspark arm plain for a whole bench, and with it every heavier load.
    trust: int = 3
    # Each probe that finds the other choice still the worse one doubles the spacing at its load, up to this factor;
    # any step that flips the choice resets it. At 4 clients (Zen 4, in process, scripts/engine_ab.py --vary)
    # drafting lost to plain by a steady ~40%, and with probes spaced by probe_cost alone the drafted steps were 3%
    # of the steps and 8% of the time: a settled verdict needs few re-checks, while a changed one is still found
    # within `max_backoff` spacings.
    max_backoff: int = 8
    # Steps in a row at one load whose choice is taken again because they could not be measured (record's
    # `counted`): a new request joining in each of them must not keep a choice forever.
    max_redo: int = 2
    # Steps over which `peak` takes the most requests (see the module's docstring); 1: a step's own count only.
    window: int = 4
    # Weight of the past in the calibration of drafted steps' expected tokens (`record`'s `expected`), per drafted
    # step at any load: ~100 steps of memory, a plain mean until then.
    calibration_decay: float = 0.99
    # (load bucket, drafted) -> moving averages of a step's (committed tokens, seconds); a drafted step's tokens are
    # the expected ones where the engine gave them (`record`), read through the calibration (`_sums`)
    sums: dict[tuple[int, bool], tuple[float, float]] = field(default_factory=dict)
    # moving averages over drafted steps at every load of (committed tokens, expected tokens), and their count
    calibration: tuple[float, float] = (0.0, 0.0)
    calibrated: int = 0
    warm: set[tuple[int, bool]] = field(default_factory=set)  # choices whose warm-up step was seen, per bucket
    steps: dict[int, int] = field(default_factory=dict)  # decisions made per load bucket
    recorded: dict[int, int] = field(default_factory=dict)  # steps recorded per load bucket
    last: dict[tuple[int, bool], int] = field(default_factory=dict)  # `recorded` at each choice's last record
    samples: dict[tuple[int, bool], int] = field(default_factory=dict)  # steps counted per (load bucket, choice)
    backoff: dict[int, int] = field(default_factory=dict)  # per load bucket: the spacing's factor (max_backoff)
    probing: dict[int, bool] = field(default_factory=dict)  # per load bucket: its latest decision was a probe
    redo: dict[int, bool] = field(default_factory=dict)  # per load bucket: the choice to take again (record)
    unmeasured: dict[int, int] = field(default_factory=dict)  # per load bucket: steps in a row not counted
    recent: deque[int] = field(default_factory=deque)  # requests in each of the last `window` steps (peak)
    held: bool = False  # the latest decision was held plain by the peak: its step is not recorded

    def peak(self, requests: int) -> int:
        """The most requests any of the last `window` steps held, this one holding `requests` (decoding or
        prefilling). Called once per step; draft takes what it returns."""
        self.recent.append(requests)
        while len(self.recent) > self.window:
            self.recent.popleft()
        return max(self.recent)

    @staticmethod
    def bucket(requests: int) -> int:
        return max(requests, 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def draft(self, requests: int, clean: bool = True, peak: int | None = None) -> bool:
        """Whether this step, with `requests` decoding, drafts for its dspark requests. A step that is not
        `clean` (it also prefills) is not measured: it takes the better choice known, plain until both are.
        `peak`: the recent steps' most requests; where drafting is known not to pay at that load, plain."""
        drafts = self._choose(requests, clean)
        self.held = drafts and peak is not None and self.bucket(peak) > self.bucket(requests) and self._plain(
            self.bucket(peak))
        if self.held:
            self.probing.pop(self.bucket(requests), None)  # a probe not taken: no verdict to confirm
        return drafts and not self.held

    def _plain(self, bucket: int) -> bool:
        """Whether drafting is known not to pay at this load: trusted averages there, or a lighter load's, say so."""
        return self._slower_below(bucket) or (self._trusted(bucket) and not self._pays(bucket))

    def _choose(self, requests: int, clean: bool) -> bool:
        """draft's choice from the averages at this step's own load."""
        b = self.bucket(requests)
        drafted, plain = self.sums.get((b, True)), self.sums.get((b, False))
        if not clean:
            return drafted is not None and plain is not None and self._pays(b)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        if self._slower_below(b):  # where drafting lost with fewer requests it loses here too: not even probed
            self.redo.pop(b, None)
            self.probing.pop(b, None)
            return False
        if b in self.redo:  # the last clean step here could not be measured: its choice once more
            return self.redo.pop(b)
        if drafted is None or plain is None:
            near = self._nearest(b)
            if near is None or self._pays(near):
                return drafted is None  # measure both first: drafting, then plain
            # the nearest load measured found drafting slower: plain first, drafting after that load's spacing
            return plain is not None and n % self.spacing(near) == 0
        best = self._pays(b)
        trusted = self._trusted(b)
        every = self.spacing(b) * self.backoff.get(b, 1) if trusted else self.probe_every
        if n % every == 0:
            self.probing[b] = trusted  # the step about to be recorded at this load is a probe (see record)
            return not best
        return best

    def _trusted(self, bucket: int) -> bool:
        return min(self.samples.get((bucket, True), 0), self.samples.get((bucket, False), 0)) >= self.trust

    def _pays(self, bucket: int) -> bool:
        """Whether drafting is the better choice at a load with both measured: faster than plain by `margin`."""
        return self._rate(self._sums(bucket, True)) >= self.margin * self._rate(self._sums(bucket, False))

    def _sums(self, bucket: int, drafted: bool) -> tuple[float, float]:
        """A choice's (tokens, seconds) averages at a load, a drafted step's expected tokens scaled by what drafted
        steps at every load committed per token expected (1 before any was given)."""
        tokens, seconds = self.sums[(bucket, drafted)]
        if drafted and self.calibrated:
            committed, expected = self.calibration
            tokens *= committed / max(expected, 1e-9)
        return tokens, seconds

    @staticmethod
    def _rate(sums: tuple[float, float]) -> float:
        return sums[0] / sums[1]

    def spacing(self, bucket: int) -> int:
        """Decisions between probes at a load whose two choices are measured: the other choice's time beyond what
        the better one takes for the same tokens, as a share of the better one's step time, kept to probe_cost."""
        (t_d, s_d), (t_p, s_p) = self._sums(bucket, True), self._sums(bucket, False)
        if self._pays(bucket):
            (t_best, s_best), (t_other, s_other) = (t_d, s_d), (t_p, s_p)
        else:
            (t_best, s_best), (t_other, s_other) = (t_p, s_p), (t_d, s_d)
        loss = s_other - t_other * s_best / max(t_best, 1e-9)  # seconds a probe costs over the better choice
        if not self._pays(bucket):
            loss *= 2  # a probe of drafting from plain drafts cold first, a step not counted (see record)
        return max(self.probe_every, math.ceil(loss / (self.probe_cost * s_best)))

    def _slower_below(self, bucket: int) -> bool:
        """Whether a lighter load, both choices' averages trusted, found drafting slower than plain. Slower, not
        short of the margin: a closed loop's tail left one request drafting at 1.02x plain's rate (its first steps),
        which kept 2 clients plain on 98% of their steps where drafting measured 1.37x plain there."""
        return any(b < bucket and self._trusted(b) and self._rate(self._sums(b, True)) < self._rate(
            self._sums(b, False)) for b, drafted in self.sums if drafted and (b, False) in self.sums)

    def _nearest(self, bucket: int) -> int | None:
        """The nearest other load with both choices measured, the heavier one on a tie (where it found drafting
        slower, a load between it and a lighter one where drafting paid is a toss-up, and plain costs less to try)."""
        measured = {b for b, drafted in self.sums if (b, not drafted) in self.sums and b != bucket}
        return min(measured, key=lambda b: (abs(b - bucket), -b), default=None)

    def record(self, requests: int, drafted: bool, tokens: int, seconds: float, counted: bool = True,
               expected: float | None = None) -> None:
        """A step's committed tokens and wall time (drafting included). Steps that also prefilled are not
        recorded: their time is mostly the prompt's. `counted=False`: a drafted step with a request drafting cold
        (see the module's docstring); its choice is taken again at this load's next clean step, a probe still. A step
        that draft held plain below its peak is not recorded (the module's docstring). `expected`: a drafted step's
        expected committed tokens (policies.expected_tokens over its verified drafts): averaged at its load in place
        of `tokens`, which calibrate it over every load (the module's docstring)."""
        if self.held:
            self.held = False
            return
        b = self.bucket(requests)
        probe = self.probing.pop(b, False)  # taken even by a step that is not counted
        if not counted:
            misses = self.unmeasured[b] = self.unmeasured.get(b, 0) + 1
            if misses <= self.max_redo:
                self.redo[b] = drafted
                if probe:
                    self.probing[b] = True
            return
        self.unmeasured.pop(b, None)
        if seconds <= 0:
            return
        key = (self.bucket(requests), drafted)
        if key not in self.warm:
            # The first step of each choice at a load pays one-off costs (the drafter's first forward at that batch:
            # 17-28 ms against ~4.5 at 1 request, Zen 5); counted, it made drafting look 6x slower than plain, and
            # the gate probed it so rarely that a request of 128 tokens never drafted again.
            self.warm.add(key)
            return
        # Tokens and seconds averaged apart, their ratio the rate: averaging each step's rate instead swung with
        # every run of short drafted rounds (1-2 tokens at 200-400 tok/s beside rounds of 6 at 1,400) and flipped
        # the choice back to plain for long stretches.
        # Aged by the steps recorded at this load since the choice was last seen, not by its own samples: the choice
        # that is not taken is only seen at probes, and with per-sample decay a bad first sample kept 35% of its
        # weight after ten probes (160+ steps). Through the server, 8 clients drafted 138 of 178 steps at 0.81x
        # plain in one run, a stale estimate the likely cause. A probe weighs at most half (one step is noisy).
        # The verdict before this step, where both choices are trusted: a probe that confirms it backs off, and any
        # step that flips it (a probe, or the chosen choice's own steps) resets the spacing. Only steps draft()
        # returned as probes count: one kept plain because a lighter load found drafting slower is no probe.
        before = self._pays(b) if self._trusted(b) and (b, not drafted) in self.sums and (b, drafted) in self.sums \
            else None
        if drafted and expected is not None:
            self._calibrate(tokens, expected)
            tokens = expected
        old = self.sums.get(key)
        if old is not None:
            # One stalled step (a 207 ms plain step among 12 ms ones, 32 requests through the server) is held to
            # `clip` times the average: counted whole, it makes plain's average 2.5x slower, enough to flip the
            # choice (that server drafted the next three steps at that load).
            seconds = min(seconds, self.clip * old[1])
        self.samples[key] = self.samples.get(key, 0) + 1
        n = self.recorded[key[0]] = self.recorded.get(key[0], 0) + 1
        age, self.last[key] = n - self.last.get(key, n - 1), n
        d = max(self.decay**age, min(self.decay, 0.5))
        if self.samples[key] <= self.trust:  # the first samples weigh alike (a plain mean): no one of them decides
            d = min(d, 1 - 1 / self.samples[key])
        self.sums[key] = (tokens, seconds) if old is None else (d * old[0] + (1 - d) * tokens,
                                                                 d * old[1] + (1 - d) * seconds)
        if before is not None:
            if self._pays(b) != before:  # flipped: the other choice is measured at the plain spacing again
                self.backoff[b] = 1
            elif probe and before != drafted:  # a probe of the other choice confirmed the verdict
                self.backoff[b] = min(2 * self.backoff.get(b, 1), self.max_backoff)

    def _calibrate(self, committed: float, expected: float) -> None:
        n = self.calibrated = self.calibrated + 1
        d = min(self.calibration_decay, 1 - 1 / n)  # a plain mean for the first 1 / (1 - decay) steps
        self.calibration = (d * self.calibration[0] + (1 - d) * committed, d * self.calibration[1] + (1 - d) * expected)

    @property
    def rates(self) -> dict[tuple[int, bool], float]:
        """(load bucket, drafted) -> committed tokens per second of that choice's recent steps (drafted steps': their
        calibrated expected tokens, `_sums`)."""
        return {key: self._rate(self._sums(*key)) for key in self.sums}
