"""The server process's life: the listening socket, per-connection read deadlines, and draining.

Start: `listen` binds before the model loads (a port in use fails at once, in one line); the
"serving" line is printed once uvicorn accepts on it. Stop: the first SIGTERM / SIGINT starts a
drain — `/health` answers 503 and new generation requests 503 at once, running requests may finish
for `graceful_timeout` seconds, then the engine cancels what is left, so every stream still ends
with its final chunk and `[DONE]`; the HTTP server stops once those responses are sent. A second
signal exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from hybridlm.engine import Engine

log = logging.getLogger("hybridlm.server")


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); raises OSError (e.g. the port is in use)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return socket.create_server((host, port), family=family, backlog=2048)


class OpenConnections:
    """How many HTTP connections are open: counted by `timed_protocol`'s protocol (asyncio's
    `connection_made` / `connection_lost`), read by `middleware.LimitConnections`."""

    def __init__(self) -> None:
        self.count = 0


def timed_protocol(head_timeout: float, connections: OpenConnections | None = None) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline: a connection that has not delivered a complete request
    head within `head_timeout` seconds (of opening, or of its previous response) is closed, so a client
    trickling header bytes cannot hold it open. Open connections are counted in `connections`."""
    connections = connections or OpenConnections()

    class TimedH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(head_timeout, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            if not self.transport.is_closing():
                log.info("event=head_timeout client=%s", self.client)
                self.transport.close()

        def connection_made(self, transport) -> None:
            connections.count += 1
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            self._arm()  # before the next pipelined request, which disarms it
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            connections.count -= 1
            self._disarm()
            super().connection_lost(exc)

    return TimedH11


class DrainingServer(uvicorn.Server):
    """uvicorn's server that drains the engine on the first stop signal (see the module docstring).
    `draining(True)` tells the app to refuse new work; `announce()` runs once listening.

    uvicorn has no public drain hook (its shutdown closes the listener before anything else, so
    /health could not answer 503, and its lifespan shutdown comes after the connections are gone):
    this overrides `Server.startup` and the signal handler `Server.handle_exit`, and stops it through
    `should_exit` — names without an underscore, but not a documented API, so pyproject pins the
    uvicorn versions this was tested with (as for `timed_protocol`'s use of `H11Protocol`)."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: Engine,
        graceful_timeout: float,
        draining: Callable[[bool], None],
        announce: Callable[[], None] | None = None,
    ):
        super().__init__(config)
        self.engine = engine
        self.graceful_timeout = graceful_timeout
        self.draining = draining
        self.announce = announce
        self._drain: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        self._loop = asyncio.get_running_loop()
        if self.started and self.announce is not None:
            self.announce()

    def handle_exit(self, sig: int, frame) -> None:
        if self._loop is None or self._drain is not None or self.should_exit:
            return super().handle_exit(sig, frame)  # not serving yet, or a second signal: stop now
        self.draining(True)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.graceful_timeout
        engine = self.engine
        log.info("event=draining running=%d queued=%d", engine.num_running, engine.queue_depth)
        while (engine.num_running or engine.queue_depth) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if engine.num_running or engine.queue_depth:
            log.warning(
                "graceful timeout (%gs): cancelling %d running and %d queued request(s)",
                self.graceful_timeout,
                engine.num_running,
                engine.queue_depth,
            )
        # Cancels what is left; each request still gets its last event (final chunk, then [DONE]).
        await asyncio.to_thread(engine.close, 10.0)
        # uvicorn's own shutdown lets the handlers send those last events (for at most the config's
        # timeout_graceful_shutdown) and closes the idle connections.
        self.should_exit = True
