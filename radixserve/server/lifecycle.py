"""How the API process ends: a graceful drain on SIGTERM, a quick exit when the engine dies.

SIGTERM (or Ctrl-C): the server keeps listening while it drains, so a load balancer sees
`/health` answer 503 and moves away; new requests get 503 `server_shutting_down`; requests in
flight get `--graceful-shutdown-timeout` seconds to finish. What is left then gets a 503 error
body, or an error event and `[DONE]` on a stream, and uvicorn's own shutdown runs. A second
signal skips the drain.

Engine death: everything in flight is answered 503 at once (the engine client does that), the
reason is logged, and the server exits with code 1 within a second or so: a supervisor (the
router's worker manager, Kubernetes, systemd) restarts it, whereas a server that stayed up
answering 503 would never be restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Callable, Generator, Optional

import uvicorn

from radixserve.server.engine_client import EngineClient

logger = logging.getLogger("radixserve")

ENGINE_DEATH_EXIT_CODE = 1
# After the drain, what uvicorn still waits for: responses being written, streams ending.
CLOSE_TIMEOUT_S = 5.0


class ServingServer(uvicorn.Server):
    """uvicorn's server with the lifecycle above. It says `serving ... on http://...` once the
    engine is ready and the port is bound, and ends a signalled shutdown with a shutdown line and
    status 0 (uvicorn would re-raise the signal: 143)."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, drain_timeout_s: float, *, announce: str,
                 on_drain_end: Optional[Callable[[], None]] = None):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.announce = announce
        self.on_drain_end = on_drain_end  # e.g. end the endless /kv_events streams
        self.exit_code = 0
        self.stop_signal: Optional[int] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.drain_task: Optional[asyncio.Task] = None
        engine.on_death = self.engine_died

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        # The engine starts before uvicorn's lifespan (whose start then finds it ready): an engine
        # that fails to start is one line and exit code 1, where a lifespan failure would print
        # uvicorn's traceback and exit 3.
        try:
            await self.engine.start()
        except RuntimeError as e:
            logger.error("server failed: %s", e)
            self.exit_code = 1
            self.should_exit = True
            return
        await super().startup(sockets)
        if self.started and not self.should_exit:
            logger.info("%s", self.announce)

    def handle_exit(self, sig, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
        if self.drain_task is not None or self.loop is None or not self.started:
            self._end_streams()
            super().handle_exit(sig, frame)  # a second signal, or nothing started yet: no drain
            return
        self.loop.call_soon_threadsafe(self._start_drain, sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # shut down on purpose: exit normally, do not re-raise

    def shutdown_line(self) -> str:
        why = f"on {signal.Signals(self.stop_signal).name}" if self.stop_signal is not None else ""
        return " ".join(p for p in ("server shut down", why) if p)

    def _start_drain(self, sig, frame) -> None:
        if self.drain_task is None:
            logger.info("shutting down: draining %d request(s) for up to %g s (/health answers 503)",
                        self.engine.requests_in_flight, self.drain_timeout_s)
            self.drain_task = asyncio.ensure_future(self._drain(sig, frame))

    async def _drain(self, sig, frame) -> None:
        try:
            await self.engine.drain(self.drain_timeout_s)
            await asyncio.sleep(0.1)  # let the cut requests' handlers write their 503s
        finally:
            self._end_streams()
            super().handle_exit(sig, frame)

    def _end_streams(self) -> None:
        if self.on_drain_end is not None:
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.on_drain_end)
            else:
                self.on_drain_end()

    def engine_died(self, reason: str) -> None:
        logger.error("%s; the server exits (code %d) so that its supervisor restarts it", reason,
                     ENGINE_DEATH_EXIT_CODE)
        self.exit_code = ENGINE_DEATH_EXIT_CODE
        self.engine.draining = reason
        self._end_streams()
        self.should_exit = True
