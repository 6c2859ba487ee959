"""Least-loaded routing inside Ray Serve (the `ray` extra): Ray's request router for the verispec deployment.

Ray's default samples two replicas and takes the shorter queue (power of two choices). This router offers every
replica in one rank; Ray's base router then probes (or reads its cache of) their ongoing-request counts and takes
the lowest (the first of equals): the rule `serve.routing.least_loaded` applies on one machine. The rank is
shuffled so that ties (an idle fleet) spread instead of always going to the same replica. Imported only where Ray
is installed.
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class LeastLoadedRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return [random.sample(candidate_replicas, len(candidate_replicas))] if candidate_replicas else []
