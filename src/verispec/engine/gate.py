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
from dataclasses import dataclass, field


@dataclass
class DraftGate:
    probe_every: int = 16  # the most often the other choice is retried
    probe_cost: float = 0.05  # the share of time probing may cost: a probe r times slower waits 1/0.05 * (r - 1) steps
    decay: float = 0.8  # weight of the past in each rate
    rates: dict[tuple[int, bool], float] = field(default_factory=dict)  # (load bucket, drafted) -> tokens/s
    steps: dict[int, int] = field(default_factory=dict)  # decisions made per load bucket

    @staticmethod
    def bucket(requests: int) -> int:
        return max(requests, 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def draft(self, requests: int, clean: bool = True) -> bool:
        """Whether this step, with `requests` decoding, drafts for its dspark requests. A step that is not
        `clean` (it also prefills) is not measured: it takes the better choice known, plain until both are."""
        b = self.bucket(requests)
        drafted, plain = self.rates.get((b, True)), self.rates.get((b, False))
        if not clean:
            return drafted is not None and plain is not None and drafted >= plain
        n = self.steps[b] = self.steps.get(b, 0) + 1
        if drafted is None or plain is None:  # measure both first: drafting, then plain
            return drafted is None
        best = drafted >= plain
        slower = max(drafted, plain) / max(min(drafted, plain), 1e-9)  # how many times slower the other choice is
        every = max(self.probe_every, math.ceil((slower - 1) / self.probe_cost))
        return (not best) if n % every == 0 else best

    def record(self, requests: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step's committed tokens and wall time (drafting included). Steps that also prefilled are not
        recorded: their time is mostly the prompt's."""
        if seconds <= 0:
            return
        key = (self.bucket(requests), drafted)
        rate = tokens / seconds
        old = self.rates.get(key)
        self.rates[key] = rate if old is None else self.decay * old + (1 - self.decay) * rate
