"""rltpu's own stderr lines go through the standard ``logging`` module, logger ``rltpu``.

Each line carries its ``rltpu: ...`` text itself (format ``%(message)s``), so at the default level (INFO)
the output is what a run always printed. ``rltpu -q ...`` (WARNING) keeps warnings and errors, ``-v``
adds DEBUG lines; ``RLTPU_LOG_LEVEL`` (a level name) sets it for every process, actors included. An
application embedding rltpu can add its own handlers to ``logging.getLogger("rltpu")`` and set
``propagate``; the stderr handler here is attached once, at import. Modules log through children
named after themselves (``get_logger(__name__)``: ``rltpu.control.controller``, ``rltpu.chips.cluster``),
so an application can filter a group (``logging.getLogger("rltpu.control")``); they take the level of
``rltpu`` unless given their own.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER = "rltpu"


class _Stderr(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a line is logged (pytest's capture, a redirected stream),
    flushed per line (StreamHandler flushes after each record)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _env_level() -> int:
    name = os.environ.get("RLTPU_LOG_LEVEL", "").strip().upper()
    level = logging.getLevelName(name) if name else logging.INFO
    return level if isinstance(level, int) else logging.INFO


def _attach() -> logging.Logger:
    log = logging.getLogger(LOGGER)
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(_env_level())
        log.propagate = False  # one line, not a second copy through the root logger's handlers
    return log


log = _attach()
_START_LEVEL = log.level


def set_verbosity(quiet: bool = False, verbose: int = 0) -> int:
    """The CLI's ``-q`` / ``-v``: WARNING or DEBUG, exported in RLTPU_LOG_LEVEL so the processes the run
    starts (an embedded cluster's Ray actors) log at the same level; neither: the level at import
    (INFO, or RLTPU_LOG_LEVEL)."""
    level = logging.WARNING if quiet else logging.DEBUG if verbose else _START_LEVEL
    log.setLevel(level)
    if quiet or verbose:
        os.environ["RLTPU_LOG_LEVEL"] = logging.getLevelName(level)
    return level


def get_logger(name: str) -> logging.Logger:
    """A child of ``rltpu`` for module ``name``: its lines go through the handler and level above (importing
    this module attaches them, so a line is never lost to Python's last-resort handler)."""
    return logging.getLogger(name if name == LOGGER or name.startswith(LOGGER + ".") else f"{LOGGER}.{name}")
