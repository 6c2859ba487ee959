"""Least-loaded routing inside Ray Serve (the `ray` extra): Ray's request router for the verispec deployment.

Ray's default samples two replicas and takes the shorter queue (power of two choices). This router offers every
replica in one rank; Ray's base router then probes (or reads its cache of) their ongoing-request counts and takes
the lowest: the rule `serve.routing.least_loaded` applies on one machine. Imported only where Ray is installed.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class LeastLoadedRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return [candidate_replicas] if candidate_replicas else []
