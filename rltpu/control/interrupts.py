"""The one interrupt path's signal side: SIGINT, SIGTERM and SIGHUP all become ``KeyboardInterrupt`` in
the driver's main thread, remembered so the CLI exits 130 (SIGINT), 143 (SIGTERM) or 129 (SIGHUP).

SIGHUP is what a closed terminal or a dropped SSH session sends: without a handler it kills the driver
with no checkpoint. A SIGHUP that arrives already ignored (``nohup rltpu train ...``) stays ignored.
After a hang-up the terminal is gone and writing to it fails (EIO): the handler points a terminal's
stdout/stderr at /dev/null first, so the stop path's output cannot break the checkpoint.

``deferred()`` holds a signal that arrives during a few statements that must happen together (a
step's batch reaching the trainers, the step count and its ledger line) and raises it right after.
``ignore()`` is for the stop path itself: once a checkpoint is being written, a second signal must
not cut it short (SIGKILL still can). ``hold()`` is for the shutdown after a run that finished or
failed: a signal is remembered (``late``) and reported once the shutdown is done, so it neither cuts
the shutdown short nor goes unanswered (ignored, a finished run exited 0 as if no signal came).
``exit_on_signal()`` covers the last moments, after the CLI's command returned: a signal then ends
the process at once with its exit code and one line (the default SIGTERM action killed it with no
line and exit -15; both seen in the interrupt fuzz when a signal landed as a 4-step run ended).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}  # 128 + signal number


def _terminal_fds() -> list[int]:
    """The fds of stdout/stderr that are a terminal now (after a hang-up ``isatty`` may fail with EIO)."""
    fds = []
    for stream in (sys.stdout, sys.stderr):
        try:
            if os.isatty(stream.fileno()):
                fds.append(stream.fileno())
        except (OSError, ValueError, AttributeError):  # a replaced or closed stream
            pass
    return fds


def _detach(fds: list[int]) -> None:
    """Point ``fds`` at /dev/null: after a hang-up every write to the terminal would raise EIO."""
    for fd in fds:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, fd)
            os.close(null)
        except OSError:
            pass


class Interrupts:
    def __init__(self):
        self.received: list[int] = []
        self.late: list[int] = []  # signals that arrived while ``hold`` was on (a shutdown)
        self._depth = 0
        self._pending = False
        self._unacknowledged = False
        self._previous: dict = {}
        self._terminal: list[int] = []  # stdout/stderr fds that were a terminal at install()

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def exit_code(self) -> int:
        return EXIT_CODES.get(self.first, 130)

    def name(self) -> str:
        return signal.Signals(self.first).name if self.first else "SIGINT"

    def handler(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            _detach(self._terminal)
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
        """The signals -> ``handler`` (main thread only; elsewhere a no-op). Also after ``ray.init``,
        which installs its own SIGTERM handler (sys.exit). An ignored SIGHUP (nohup) stays ignored."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._terminal = self._terminal or _terminal_fds()
        self._set_all(self.handler)

    def ignore(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                if s not in self._previous:  # a nohup-ignored SIGHUP: restore() must leave it ignored
                    self._previous[s] = signal.getsignal(s)
                signal.signal(s, signal.SIG_IGN)

    def _set_all(self, action) -> None:
        """Every signal -> ``action``, remembering what was there for ``restore``; a SIGHUP that was
        ignored (nohup) stays ignored."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            if s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN and \
                    self._previous.get(s, signal.SIG_IGN) == signal.SIG_IGN:
                continue
            prev = signal.signal(s, action)
            self._previous.setdefault(s, prev)

    def _remember(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            _detach(self._terminal)
        self.late.append(signum)

    def hold(self) -> None:
        """Shutting down: a signal is remembered in ``late``, never raised."""
        self._set_all(self._remember)

    def late_name(self) -> str:
        return signal.Signals(self.late[0]).name

    def late_exit_code(self) -> int:
        return EXIT_CODES.get(self.late[0], 130)

    def exit_on_signal(self, what: str) -> None:
        """From now to the process's end a signal prints ``rltpu: stopped by <SIGNAL> <what>`` and
        exits at once with its code (nothing is left to save: the command has returned)."""
        def _exit(signum, frame):
            if signum == signal.SIGHUP:
                _detach(self._terminal)
            try:
                print(f"rltpu: stopped by {signal.Signals(signum).name} {what}", file=sys.stderr, flush=True)
            finally:
                os._exit(EXIT_CODES.get(signum, 130))

        self._set_all(_exit)

    def reassert(self) -> None:
        """Install again, at the C level, the handlers Python believes are installed (a library's C
        code can reset a signal's action behind Python's back: Ray's core worker does for SIGTERM)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in SIGNALS:
            handler = signal.getsignal(s)
            if callable(handler):
                signal.signal(s, handler)

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
