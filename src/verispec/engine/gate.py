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
    decay: float = 0.9  # weight of the past in each choice's token and time averages
    # (load bucket, drafted) -> moving averages of a step's (committed tokens, seconds)
    sums: dict[tuple[int, bool], tuple[float, float]] = field(default_factory=dict)
    warm: set[tuple[int, bool]] = field(default_factory=set)  # choices whose warm-up step was seen, per bucket
    steps: dict[int, int] = field(default_factory=dict)  # decisions made per load bucket

    @staticmethod
    def bucket(requests: int) -> int:
        return max(requests, 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...

    def draft(self, requests: int, clean: bool = True) -> bool:
        """Whether this step, with `requests` decoding, drafts for its dspark requests. A step that is not
        `clean` (it also prefills) is not measured: it takes the better choice known, plain until both are."""
        b = self.bucket(requests)
        rates = self.rates
        drafted, plain = rates.get((b, True)), rates.get((b, False))
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
        if key not in self.warm:
            # The first step of each choice at a load pays one-off costs (the drafter's first forward at that batch:
            # 17-28 ms against ~4.5 at 1 request, Zen 5); counted, it made drafting look 6x slower than plain, and
            # the gate probed it so rarely that a request of 128 tokens never drafted again.
            self.warm.add(key)
            return
        # Tokens and seconds averaged apart, their ratio the rate: averaging each step's rate instead swung with
        # every run of short drafted rounds (1-2 tokens at 200-400 tok/s beside rounds of 6 at 1,400) and flipped
        # the choice back to plain for long stretches.
        old = self.sums.get(key)
        d = self.decay
        self.sums[key] = (tokens, seconds) if old is None else (d * old[0] + (1 - d) * tokens,
                                                                 d * old[1] + (1 - d) * seconds)

    @property
    def rates(self) -> dict[tuple[int, bool], float]:
        """(load bucket, drafted) -> committed tokens per second of that choice's recent steps."""
        return {key: t / s for key, (t, s) in self.sums.items()}
