"""Whether a step drafts for the dspark policy at all, from what drafting steps and plain steps delivered.

The dspark cut (policies.dspark_cut) decides how much of a draft to verify once it exists, with the drafting time
already spent. Under load that time is the problem: a drafter proposes for every request each step, and when most
drafts are cut anyway, the step is slower than plain (measured through the server: 8-64 clients, dspark 0.7x
plain's aggregate). The gate compares committed tokens per second of recent steps that drafted and of steps that
did not, per load (the number of decoding requests, in powers of two), and drafts only where drafting has paid;
the other choice is retried now and then so that a change of load, text or acceptance shows: every `probe_every`
steps, or more rarely when it is much slower, so that probing costs at most `probe_cost` of the time (a drafted
step at 32 requests took 83 ms against a plain one's 9.7: probing it every 16th step cost half the throughput).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class DraftGate:
    probe_every: int = 16  # the most often the other choice is retried
    probe_cost: float = 0.05  # the share of time probing may cost: a probe r times slower waits (r - 1) / 0.05 steps
    probe_most: int = 128  # and never more than this many steps apart
    first: int = 3  # samples of each choice before either is preferred
    window: int = 16  # each choice's rate comes from its last `window` steps
    margin: float = 1.1  # plain must be this much faster to stop drafting: the cut already trims each draft, and
    # acceptance comes in runs, so a short spell of poor drafts should not switch drafting off
    samples: dict[tuple[int, bool], deque] = field(default_factory=dict)  # (bucket, drafted) -> (tokens, seconds)
    steps: dict[int, int] = field(default_factory=dict)  # clean decisions made per load bucket
    warm: set[tuple[int, bool]] = field(default_factory=set)  # (bucket, drafted) whose first step was seen

    @staticmethod
    def bucket(requests: int) -> int:
        return max(requests, 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def rate(self, bucket: int, drafted: bool) -> float | None:
        """Tokens per second over the recent steps: their sums, because drafted steps commit 1 to k + 1 tokens
        and the few long runs carry the mean."""
        got = self.samples.get((bucket, drafted), ())
        if len(got) < self.first:
            return None
        return sum(t for t, _ in got) / sum(s for _, s in got)

    def draft(self, requests: int, clean: bool = True) -> bool:
        """Whether this step, with `requests` decoding, drafts for its dspark requests. A step that is not
        `clean` (it also prefills) is not measured: it takes the better choice known, plain until both are."""
        b = self.bucket(requests)
        drafted, plain = self.rate(b, True), self.rate(b, False)
        if not clean:
            return drafted is not None and plain is not None and drafted * self.margin >= plain
        n = self.steps[b] = self.steps.get(b, 0) + 1
        if drafted is None or plain is None:  # `first` samples of each, alternating
            return len(self.samples.get((b, True), ())) <= len(self.samples.get((b, False), ()))
        best = drafted * self.margin >= plain
        slower = max(drafted, plain) / max(min(drafted, plain), 1e-9)  # how many times slower the other choice is
        every = min(self.probe_most, max(self.probe_every, math.ceil((slower - 1) / self.probe_cost)))
        return (not best) if n % every == 0 else best

    def record(self, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step's committed tokens and wall time (drafting included). Steps that also prefilled are not
        recorded: their time is mostly the prompt's."""
        if seconds <= 0:
            return
        key = (self.bucket(requests), drafted)
        if key not in self.warm:  # the first step of each kind at each load pays one-off costs (allocations)
            self.warm.add(key)
            return
        self.samples.setdefault(key, deque(maxlen=self.window)).append((tokens, seconds))
