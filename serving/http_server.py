"""uvicorn's server with the pool's shutdown: nothing the server read goes unanswered.

`GracefulServer` is what `python -m serving.main` runs. On SIGTERM or Ctrl-C the engine stops
admitting (new requests get 503) and its shutdown deadline starts (`--shutdown_timeout_s`);
for `read_grace` seconds the server still reads what clients already sent (requests in flight
on open connections, connections waiting to be accepted) and answers it with 503, instead of
closing those connections unanswered as plain uvicorn does; then it closes the listener and
idle connections and waits for the requests in flight. A second Ctrl-C (uvicorn's force quit)
moves the engine's deadline to now: every unfinished request is answered with the JSON 503 and
flushed (up to `flush_timeout` seconds), and the engine stops without waiting for running
prefills (uvicorn's own force quit would skip the app's shutdown and cancel the requests, which
then get a plain-text 500 and a logged traceback each).

It also closes a connection that has not completed a request's headers `header_timeout` seconds
after it opened or after its last response (uvicorn closes idle keep-alive connections after 5 s
but waits forever for headers that never end; the body's own deadline is
`serving.http_gate.RequestGate`'s).
"""

from __future__ import annotations

import asyncio
import signal
import time

import uvicorn


class GracefulServer(uvicorn.Server):
    """`uvicorn.Server` with the shutdown described in the module docstring.

    Args:
      config: the `uvicorn.Config`.
      engine: the app's `serving.engine.Engine` (`request_shutdown(timeout)` is called from the
        signal handler).
      shutdown_timeout: seconds after the first signal before unfinished requests get 503
        (None: wait for them).
      read_grace: seconds the listener stays open after the signal, answering 503 (>= 0).
      flush_timeout: seconds a forced quit waits for the 503 answers to be written.
      header_timeout: seconds a connection may spend between requests with its next request's
        headers incomplete before it is closed (checked once a second).
    """

    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float | None,
                 read_grace: float = 0.5, flush_timeout: float = 2.0,
                 header_timeout: float = 30.0) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.read_grace, self.flush_timeout = read_grace, flush_timeout
        self.header_timeout = header_timeout
        # connection -> (its last request's cycle, seen between requests since)
        self._waiting_since: dict[object, tuple[object, float]] = {}

    async def on_tick(self, counter: int) -> bool:
        if counter % 10 == 0:
            self._close_stalled(time.monotonic())
        return await super().on_tick(counter)

    def _close_stalled(self, now: float) -> None:
        """Closes the connections whose next request's headers are overdue (h11 and httptools
        connections both have `cycle`, None before the first request, and `transport`)."""
        live = set(self.server_state.connections)
        for conn in list(self._waiting_since):
            if conn not in live:
                del self._waiting_since[conn]
        for conn in live:
            cycle = getattr(conn, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                self._waiting_since.pop(conn, None)  # a request in progress
                continue
            entry = self._waiting_since.get(conn)
            if entry is None or entry[0] is not cycle:  # new, or a request ended since
                entry = self._waiting_since[conn] = (cycle, now)
            if now - entry[1] > self.header_timeout:
                del self._waiting_since[conn]
                conn.transport.close()

    def handle_exit(self, sig, frame) -> None:
        forced = self.should_exit and sig == signal.SIGINT
        super().handle_exit(sig, frame)
        self.engine.request_shutdown(0.0 if forced else self.shutdown_timeout, force=forced)

    async def shutdown(self, sockets=None) -> None:
        if self.read_grace > 0 and not self.force_exit:
            await asyncio.sleep(self.read_grace)
        await super().shutdown(sockets)
        if self.force_exit:  # the engine answers everything unfinished now: let it be written
            loop = asyncio.get_running_loop()
            end = loop.time() + self.flush_timeout
            while self.server_state.tasks and loop.time() < end:
                await asyncio.sleep(0.02)
            await self.lifespan.shutdown()  # the engine stops without waiting for prefills
