"""A daemon thread that calls a tick at once and then every period until stopped: what keeps a
signed value alive in the DHT (manifests, device records, the address book)."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


class Periodic:
    """Calls :meth:`tick` at once and then every ``period_s`` on a daemon thread until :meth:`stop`.

    A tick that raises is logged at debug level and tried again next period: the DHT it talks to
    may be starting or shutting down. Subclasses implement :meth:`tick`.
    """

    def __init__(self, *, period_s: float, name: str):
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def tick(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as exc:
                logger.debug("%s failed: %r; retrying in %.0f s", self._thread.name, exc, self.period_s)
            self._stop.wait(self.period_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread; waits up to ``timeout_s`` for a tick in progress."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)
