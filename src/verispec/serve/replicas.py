"""Engine replicas on one machine: N worker processes, each a whole `verispec serve` on a loopback port, kept
alive by a supervisor that the router (`serve.router`) asks for the least-loaded ready one.

Why processes: one engine thread per process owns its interpreter's GIL, so N replicas run N engine steps at once.
Each worker answers only the router: it listens on 127.0.0.1 and needs a per-launch random key (passed in its
environment, not its argv, which other users can read). A worker that exits is started again (with backoff when it
keeps failing), and one whose /ready keeps failing (a wedged engine) is killed first; requests it had in flight
see their connection drop, which the router turns into a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from verispec.errors import ConfigError
from verispec.serve.routing import least_loaded

log = logging.getLogger("verispec.serve.replicas")
WORKER_KEY_ENV = "VERISPEC_API_KEY"  # what `verispec serve` reads its key from


@dataclass(frozen=True)
class ReplicaConfig:
    """How `verispec serve --replicas N` runs its engine replicas."""

    replicas: int = 2
    start_timeout_s: float = 300.0  # a worker not ready by then (loading a model) is killed and started again
    health_period_s: float = 2.0  # how often a ready worker's /ready is polled
    health_timeout_s: float = 5.0  # one poll's limit (a busy 2-core machine answers slowly, not never)
    health_failures: int = 3  # consecutive failed polls of a running worker before it is killed and restarted
    restart_backoff_s: float = 0.5  # delay before restarting a worker; doubles per consecutive failed start
    max_restart_backoff_s: float = 30.0
    poll_s: float = 0.1  # how often the supervisor looks at its processes

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if min(self.start_timeout_s, self.health_period_s, self.health_timeout_s, self.poll_s) <= 0:
            raise ConfigError("replica timeouts and periods must be > 0")
        if self.health_failures < 1:
            raise ConfigError(f"health_failures must be >= 1, got {self.health_failures}")


@dataclass
class Replica:
    """One worker process and what the router knows of it. `generation` counts its starts: a lease taken on an
    earlier generation no longer counts against the load of the process that replaced it."""

    index: int
    port: int = 0
    process: subprocess.Popen | None = None
    ready: bool = False
    in_flight: int = 0
    generation: int = 0
    restarts: int = 0
    routed: int = 0  # requests sent to it, over all its generations
    failed_starts: int = 0  # consecutive starts that never became ready
    started_at: float = 0.0
    restart_at: float = 0.0  # when a dead worker is started again
    next_check: float = 0.0
    health_misses: int = 0
    last_exit: int | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


@dataclass(frozen=True)
class Lease:
    replica: Replica
    generation: int


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def _prctl():
    """glibc's prctl, resolved in the parent: the child between fork and exec must not load libraries (the
    loader's lock may be held by another thread of the parent at fork time)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent_preexec():
    """A preexec_fn (Linux) that has the child SIGKILLed when the thread that started it exits, so a killed router
    leaves no orphaned engines holding memory; None where prctl is missing."""
    prctl = _prctl() if sys.platform.startswith("linux") else None
    if prctl is None:
        return None
    return lambda: prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class ReplicaSet:
    """The supervisor. `command` starts one worker without its port (`--port P` is appended); every method runs
    on the router's event loop, so the counts need no lock."""

    command: Sequence[str]
    config: ReplicaConfig = field(default_factory=ReplicaConfig)
    env: dict[str, str] | None = None  # the workers' environment (default: this process's)

    def __post_init__(self) -> None:
        self.key = secrets.token_urlsafe(32)
        self.replicas = [Replica(i) for i in range(self.config.replicas)]
        self._next = 0  # the tie-break start of least_loaded
        self._task: asyncio.Task | None = None
        self._client: httpx.AsyncClient | None = None

    # ---- routing ----------------------------------------------------------------------------------------------
    def acquire(self) -> Lease | None:
        """The least-loaded ready replica, with one more request counted against it; None when none is ready."""
        i = least_loaded([r.in_flight if r.ready else None for r in self.replicas], self._next)
        if i is None:
            return None
        self._next = (i + 1) % len(self.replicas)
        r = self.replicas[i]
        r.in_flight += 1
        r.routed += 1
        return Lease(r, r.generation)

    def release(self, lease: Lease) -> None:
        if lease.generation == lease.replica.generation:  # else the process it counted against is gone
            lease.replica.in_flight -= 1

    def url(self, replica: Replica) -> str:
        return f"http://127.0.0.1:{replica.port}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.config.health_timeout_s, trust_env=False)
        for r in self.replicas:
            self._spawn(r)
        self._task = asyncio.create_task(self._supervise(), name="verispec-replicas")

    async def close(self, timeout: float = 10.0) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for r in self.replicas:
            r.ready = False
            if r.process is not None and r.process.poll() is None:
                r.process.terminate()  # SIGTERM: uvicorn shuts down gracefully
        deadline = time.monotonic() + timeout
        for r in self.replicas:
            if r.process is None:
                continue
            try:
                await asyncio.to_thread(r.process.wait, max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                r.process.kill()
                await asyncio.to_thread(r.process.wait)
        if self._client is not None:
            await self._client.aclose()

    def kill(self, index: int) -> None:
        """SIGKILL a worker (as a crash would); the supervisor restarts it."""
        r = self.replicas[index]
        if r.process is not None and r.process.poll() is None:
            r.process.kill()

    def _spawn(self, r: Replica) -> None:
        r.port = _free_loopback_port()
        env = dict(os.environ if self.env is None else self.env)
        env[WORKER_KEY_ENV] = self.key
        r.process = subprocess.Popen([*self.command, "--port", str(r.port)], env=env, stdin=subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent_preexec())  # noqa: PLW1509 - one prctl call
        r.ready, r.health_misses = False, 0
        r.started_at = r.next_check = time.monotonic()
        log.info("replica %d: started pid %d on 127.0.0.1:%d", r.index, r.process.pid, r.port)

    async def _supervise(self) -> None:
        while True:
            now = time.monotonic()
            await asyncio.gather(*(self._tend(r, now) for r in self.replicas))
            await asyncio.sleep(self.config.poll_s)

    async def _tend(self, r: Replica, now: float) -> None:
        cfg = self.config
        if r.process is None:  # dead, waiting for its restart time
            if now >= r.restart_at:
                self._spawn(r)
            return
        code = r.process.poll()
        if code is not None:
            self._died(r, code, now)
            return
        if now < r.next_check:
            return
        r.next_check = now + (cfg.health_period_s if r.ready else cfg.poll_s * 5)
        ok = await self._ready(r)
        if r.process is None or r.process.poll() is not None:
            return  # died while we asked; the next pass restarts it
        if ok:
            if not r.ready:
                log.info("replica %d: ready (pid %d)", r.index, r.process.pid)
            r.ready, r.health_misses, r.failed_starts = True, 0, 0
        elif r.ready:
            r.health_misses += 1
            if r.health_misses >= cfg.health_failures:
                log.warning("replica %d: /ready failed %d times; killing pid %d", r.index, r.health_misses,
                            r.process.pid)
                r.process.kill()
        elif now - r.started_at > cfg.start_timeout_s:
            log.warning("replica %d: not ready after %.0f s; killing pid %d", r.index, cfg.start_timeout_s,
                        r.process.pid)
            r.process.kill()

    async def _ready(self, r: Replica) -> bool:
        assert self._client is not None
        try:
            resp = await self._client.get(f"{self.url(r)}/ready", headers=self.auth)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    def _died(self, r: Replica, code: int, now: float) -> None:
        cfg = self.config
        if not r.ready:
            r.failed_starts += 1
        delay = min(cfg.restart_backoff_s * 2 ** max(r.failed_starts - 1, 0), cfg.max_restart_backoff_s)
        log.warning("replica %d: pid %d exited with %d; restarting in %.1f s", r.index, r.process.pid if r.process
                    else -1, code, delay)
        r.ready, r.process, r.last_exit = False, None, code
        r.in_flight, r.generation, r.restarts = 0, r.generation + 1, r.restarts + 1
        r.restart_at = now + delay
