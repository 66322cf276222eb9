"""The one interrupt path's signal side: SIGINT and SIGTERM both become ``KeyboardInterrupt`` in the
driver's main thread, remembered so the CLI exits 130 (SIGINT) or 143 (SIGTERM).

``deferred()`` holds a signal that arrives during a few statements that must happen together (a
step's batch reaching the trainers, the step count and its ledger line) and raises it right after.
``ignore()`` is for the stop path itself: once a checkpoint is being written, a second signal must
not cut it short (SIGKILL still can).
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    def __init__(self):
        self.received: list[int] = []
        self._depth = 0
        self._pending = False
        self._unacknowledged = False
        self._previous: dict = {}

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def exit_code(self) -> int:
        return 143 if self.first == signal.SIGTERM else 130

    def name(self) -> str:
        return signal.Signals(self.first).name if self.first else "SIGINT"

    def handler(self, signum, frame) -> None:
        self.received.append(signum)
        self._unacknowledged = True
        if self._depth:
            self._pending = True
            return
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def check(self) -> None:
        """Raise again a signal whose KeyboardInterrupt was swallowed: one raised inside a finalizer,
        a C extension's callback or an import hook is printed as "Exception ignored" and lost, and
        the run would go on. Called at every phase change and between start-up stages."""
        if self._unacknowledged and not self._depth:
            raise KeyboardInterrupt(self.name())

    def acknowledge(self) -> None:
        """The stop path has the interrupt: no more re-raising."""
        self._unacknowledged = False

    def install(self) -> None:
        """Both signals -> ``handler`` (main thread only; elsewhere a no-op). Also after ``ray.init``,
        which installs its own SIGTERM handler (sys.exit)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            prev = signal.signal(s, self.handler)
            self._previous.setdefault(s, prev)

    def ignore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                signal.signal(s, signal.SIG_IGN)

    def restore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s, prev in self._previous.items():
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            self._previous = {}

    @contextmanager
    def deferred(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending:
                self._pending = False
                raise KeyboardInterrupt(self.name())


INTERRUPTS = Interrupts()
