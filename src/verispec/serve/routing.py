"""Least-loaded replica choice: the one rule both replica layers route by (`serve.replicas` on one machine, the
Ray Serve application across a cluster).

Load is the number of requests a replica has in flight (admitted and not yet answered). Ties go round-robin from
a moving start, so an idle fleet still spreads one-at-a-time traffic over every replica instead of piling it on
the first.
"""

from __future__ import annotations

from collections.abc import Sequence


def least_loaded(loads: Sequence[int | None], start: int = 0) -> int | None:
    """Index of the replica with the fewest requests in flight, or None when none can take one.

    Args:
        loads: per replica, its in-flight count, or None for a replica that is not ready (starting, dead,
            restarting); never chosen.
        start: where the tie-break scan begins (the caller advances it after each choice).

    Example: least_loaded([2, None, 1, 1], start=3) == 3 (replicas 2 and 3 tie at 1; the scan starts at 3).
    """
    n = len(loads)
    best: int | None = None
    for step in range(n):
        i = (start + step) % n
        load = loads[i]
        if load is not None and (best is None or load < loads[best]):  # type: ignore[operator]
            best = i
    return best
