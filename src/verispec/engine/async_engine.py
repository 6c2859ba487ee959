"""The engine on a background thread, with an asyncio front: what the server and the load benchmark use.

The loop thread owns the engine and runs `step` while there is work; callers add and abort from the event loop.
Each request's outputs reach its own asyncio queue. Leaving `generate` early (a client disconnect, `aclose()`,
task cancellation) aborts the request and frees its cache at the next step.

A step's outputs cross to each event loop in one call: on 2 cores every wake-up of the event loop's thread takes a
CPU from the forward's OpenMP workers. A request submitted `final_only` (a non-streaming response) is woken once,
when it finishes, with everything it emitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from verispec.config import RequestSpec, SamplingParams
from verispec.engine.engine import Engine
from verispec.engine.request import RequestOutput
from verispec.threads import release_openmp_threads


@functools.cache
def _malloc_trim():  # glibc's malloc_trim, or None (musl, macOS)
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc `malloc_trim(0)`); False where there is no glibc.

    A request's KV cache is megabytes, zeroed when allocated. glibc raises its mmap threshold to the largest
    block freed so far (up to 32 MiB), so after the first few caches they come from the heap arenas, and a freed
    cache's pages stay resident unless they sit at an arena's top: RSS holds the peak of past bursts
    (reports/soak/README.md). A trim that returns 476 MiB takes 73 ms on a busy 2-core machine, and 0.03 ms when
    there is nothing to return, so the loop trims only when it has run out of work for TRIM_AFTER_S."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0) >= 0)


@dataclass
class _Sink:
    """Where a request's outputs go: its caller's event loop and queue."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    final_only: bool = False  # deliver one output when it finishes, holding the tokens and text of every step
    tokens: list[int] = field(default_factory=list)  # held back so far (final_only)
    text: list[str] = field(default_factory=list)

    def take(self, out: RequestOutput) -> RequestOutput | None:
        """What to deliver for `out` now (None: hold it back)."""
        if not self.final_only:
            return out
        if not out.finished:
            self.tokens += out.token_ids
            self.text.append(out.text)
            return None
        if not self.tokens and not self.text:
            return out
        return RequestOutput(out.request_id, self.tokens + out.token_ids, "".join(self.text) + out.text, out.result)


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class AsyncEngine:
    TRIM_AFTER_S = 0.2  # idle time after a burst before release_free_memory

    def __init__(self, engine: Engine, trim_when_idle: bool = True) -> None:
        self.engine = engine
        self.trim_when_idle = trim_when_idle  # release_free_memory() each time the engine runs out of work
        self._sinks: dict[str, _Sink] = {}
        self._sinks_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None  # set if the loop died
        self.last_step_s = 0.0  # wall time of the last step (for health)
        engine.on_outputs = self._deliver
        self._thread = threading.Thread(target=self._loop, name="verispec-engine", daemon=True)

    def start(self) -> AsyncEngine:
        release_openmp_threads()  # the loop thread runs every forward from now on (see release_openmp_threads)
        self.engine.step_thread = self._thread
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        idle_since: float | None = None  # when the engine last ran out of work, until the burst's trim
        try:
            while not self._stop.is_set():
                if not self.engine.has_unfinished():
                    now = time.perf_counter()
                    idle_since = idle_since or now
                    # Once per burst, and only once the engine has stayed idle: a closed-loop client's next request
                    # comes ~7 ms after its last, and a trim between them made it fault its pages in again (the
                    # plain server at one client 3% slower, Zen 5).
                    if self.trim_when_idle and now - idle_since >= self.TRIM_AFTER_S:
                        release_free_memory()
                        idle_since = math.inf
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                idle_since = None
                t0 = time.perf_counter()
                self.engine.step()
                self.last_step_s = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001  (reported through /ready and to every waiting request)
            self.error = e
            self._fail_waiting(e)
            return
        self._fail_waiting(RuntimeError("the engine was shut down"))  # nobody will answer them now

    def _fail_waiting(self, error: BaseException) -> None:
        with self._sinks_lock:
            sinks = list(self._sinks.values())
        self._send([(sink, error) for sink in sinks])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, to their callers' queues: one hand-over per event loop."""
        ready: list[tuple[_Sink, object]] = []
        with self._sinks_lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is None:
                    continue
                if out.finished:
                    del self._sinks[out.request_id]
                item = sink.take(out)
                if item is not None:
                    ready.append((sink, item))
        self._send(ready)

    @staticmethod
    def _send(items: list[tuple[_Sink, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for sink, item in items:
            by_loop.setdefault(sink.loop, []).append((sink.queue, item))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that caller's event loop is already closed
                loop.call_soon_threadsafe(_put_all, batch)

    def submit(
        self, prompt: list[int], params: SamplingParams, spec: RequestSpec = RequestSpec(),
        request_id: str | None = None, final_only: bool = False,
    ) -> tuple[str, asyncio.Queue]:
        """Queue a request (raises ConfigError / QueueFull at once) and return its id and output queue; with
        `final_only` the queue gets one output, when the request finishes, holding all its tokens and text."""
        if self.error is not None:
            raise RuntimeError(f"the engine loop has stopped: {self.error!r}")
        if self._stop.is_set():  # queued on a stopped loop, the request would wait forever
            raise RuntimeError("the engine was shut down")
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        rid = request_id or f"req-{uuid.uuid4().hex}"
        with self._sinks_lock:  # registered first: the loop thread may emit before add_request returns
            self._sinks[rid] = _Sink(loop, queue, final_only)
        try:
            self.engine.add_request(prompt, params, spec, rid)
        except BaseException:
            with self._sinks_lock:
                self._sinks.pop(rid, None)
            raise
        self._wake.set()
        return rid, queue

    def abort(self, request_id: str) -> None:
        with self._sinks_lock:
            self._sinks.pop(request_id, None)
        self.engine.abort(request_id)
        self._wake.set()

    def check_idle(self) -> None:
        """`Engine.check_idle`, plus: no request's output queue is registered."""
        with self._sinks_lock:
            sinks = list(self._sinks)
        assert not sinks, f"output queues still registered for {sinks[:5]}"
        self.engine.check_idle()

    async def stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Outputs of a submitted request until it finishes; leaving early aborts it."""
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"the engine failed: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def generate(
        self, prompt: list[int], params: SamplingParams, spec: RequestSpec = RequestSpec(),
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        rid, queue = self.submit(prompt, params, spec, request_id)
        async for out in self.stream(rid, queue):
            yield out
