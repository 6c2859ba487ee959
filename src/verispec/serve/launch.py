"""Starting an HTTP endpoint: the bind check, uvicorn's settings, and the replica router (`verispec serve
--replicas N`). Nothing here imports torch: the router process holds no model, its workers do."""

from __future__ import annotations

from verispec.errors import ConfigError
from verispec.serve.guard import is_loopback
from verispec.serve.protocol import ServeLimits
from verispec.serve.replicas import ReplicaConfig, ReplicaSet
from verispec.serve.router import create_router_app


def serve_replicas(command: list[str], config: ReplicaConfig, host: str = "127.0.0.1", port: int = 8000, *,
                   api_key: str | None = None, max_body_bytes: int = 4 << 20, limits: ServeLimits = ServeLimits(),
                   log_level: str = "info") -> None:
    """The router on host:port in front of `config.replicas` workers, each started as `command --port P`."""
    check_bind(host, api_key)
    run_app(create_router_app(ReplicaSet(command, config), api_key, max_body_bytes, limits), host, port, log_level)


def check_bind(host: str, api_key: str | None) -> None:
    if not is_loopback(host) and not api_key:
        raise ConfigError(f"refusing to listen on {host} without --api-key: anyone who can reach it could use it")


def run_app(app, host: str, port: int, log_level: str = "info") -> None:
    import uvicorn

    # http="h11" always: its incomplete-event cap is the header-size limit, and uvicorn would otherwise pick
    # httptools (which ignores that setting) wherever it is installed (uvicorn[standard], Ray Serve's extra).
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5, http="h11",
                h11_max_incomplete_event_size=64 * 1024)
