"""The same server as a Ray Serve application (`verispec serve --replicas N --ray`, `pip install verispec[ray]`):
for fleets beyond one machine. Each replica is a Ray actor running the single server's app (`serve.app`: the same
routes, checks and API key) over its own engine; Ray's proxy is the one endpoint and routes each request to the
replica with the fewest ongoing requests (`serve.ray_router.LeastLoadedRouter`). Ray restarts a replica whose actor
dies or whose `check_health` fails (a dead engine loop).

On one machine prefer `--replicas N` without `--ray` (`serve.replicas`): Ray's own control plane (GCS, raylets,
workers) listens on every interface, protected by Ray's cluster token, whereas the local router binds loopback
only. Ray's proxy also answers its own `/-/healthz` and `/-/routes` without the API key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from verispec.config import DEFAULT_DTYPE, EngineConfig
from verispec.serve.launch import check_bind
from verispec.serve.protocol import ServeLimits

REPLICA_HEADER = b"x-verispec-replica"


@dataclass(frozen=True)
class RayServeConfig:
    """One Ray Serve deployment of verispec; `target` must be readable at the same path on every node."""

    target: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    replicas: int = 2
    dtype: str = DEFAULT_DTYPE
    api_key: str | None = None
    model_name: str | None = None
    max_body_bytes: int = 4 << 20
    drafters: tuple[str, ...] = ()
    limits: ServeLimits = field(default_factory=ServeLimits)
    threads: int | None = None  # per replica (None: the node's CPUs divided by its replicas, as Ray reserves them)
    num_cpus: float = 1.0  # Ray CPUs each replica reserves: how Ray packs replicas onto nodes
    health_check_period_s: float = 2.0


class _Replica:
    """One engine and its app (the class Ray Serve instantiates on a replica actor)."""

    def __init__(self, cfg: RayServeConfig) -> None:
        from verispec.api import set_threads
        from verispec.serve.server import build_state

        set_threads(cfg.threads or max(1, int(cfg.num_cpus)))
        self.state = build_state(Path(cfg.target), cfg.engine, dtype=cfg.dtype, api_key=cfg.api_key,
                                 model_name=cfg.model_name, max_body_bytes=cfg.max_body_bytes,
                                 drafters=cfg.drafters, limits=cfg.limits)

    def __serve_build_asgi_app__(self):
        from ray import serve

        from verispec.serve.app import create_app

        return _Tagged(create_app(self.state), serve.get_replica_context().replica_id.unique_id.encode())

    def check_health(self) -> None:
        """Ray's health probe: raising makes Ray replace this replica (the engine loop died)."""
        if not self.state.engine.alive:
            raise RuntimeError(f"the engine loop has stopped: {self.state.engine.error!r}")


class _Tagged:
    """Adds `x-verispec-replica: <Ray replica id>` to every response (which replica served it)."""

    def __init__(self, app, tag: bytes) -> None:
        self.app, self.tag = app, tag

    async def __call__(self, scope, receive, send) -> None:
        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, self.tag)]}
            await send(message)

        await self.app(scope, receive, tagged if scope["type"] == "http" else send)


def application(cfg: RayServeConfig):
    """The bound Ray Serve application (`serve.run(application(cfg))`)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from verispec.serve.ray_router import LeastLoadedRouter

    engine = cfg.engine
    deployment = serve.deployment(
        serve.ingress()(_Replica), name="verispec", num_replicas=cfg.replicas,
        # Ray queues beyond this at its proxy; the engine's own queue (and its 429) comes first.
        max_ongoing_requests=engine.max_running + engine.max_queued,
        ray_actor_options={"num_cpus": cfg.num_cpus}, health_check_period_s=cfg.health_check_period_s,
        request_router_config=RequestRouterConfig(request_router_class=LeastLoadedRouter),
    )
    return deployment.bind(cfg)


def start(cfg: RayServeConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """Attach to the cluster at $RAY_ADDRESS (or start a local one, without dashboard or usage reporting) and run
    the application with Ray's proxy on host:port."""
    check_bind(host, cfg.api_key)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network at run time
    import ray
    from ray import serve

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        local = {} if address else {"include_dashboard": False}  # a cluster's own settings stand
        ray.init(address=address, log_to_driver=False, **local)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(cfg), name="verispec", route_prefix="/")


def run(cfg: RayServeConfig, host: str = "127.0.0.1", port: int = 8000) -> None:
    """`start`, then serve until SIGINT or SIGTERM, then shut the application (and a local Ray) down."""
    import signal
    import threading

    import ray
    from ray import serve

    stop = threading.Event()
    start(cfg, host, port)
    # After ray.init: its failure handler would otherwise take SIGTERM and leave the actors running.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
