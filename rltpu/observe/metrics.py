"""Per-step metrics: one JSON line per step in ``metrics.jsonl``, and the progress display.

On a terminal the display is a tqdm bar; written anywhere else (CI, Kubernetes, ``| tee``) it is a
plain line every ``PLAIN_EVERY_S`` seconds (and at the last step) instead of carriage-return
updates. Any figure may be missing (``None``: e.g. the sync figures of a step interrupted after its
update) and shows as ``-``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rltpu.observe.jsonl import read_jsonl, repair_tail

PLAIN_EVERY_S = 30.0


def fmt(value, spec: str, unit: str = "") -> str:
    """``value`` formatted with ``spec``, or ``-`` when it is missing or not a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:{spec}}{unit}"
    return "-"


def summary(record: dict) -> str:
    return (f"reward={fmt(record.get('reward_mean'), '.3f')} sample={fmt(record.get('sample_s'), '.2f', 's')} "
            f"train={fmt(record.get('train_s'), '.2f', 's')} sync={fmt(record.get('sync_s'), '.2f', 's')}")


class MetricsWriter:
    def __init__(self, path: Path, total_steps: int, progress: bool, stream=None):
        self.path = Path(path)
        repair_tail(self.path)  # a torn line from a crash mid-append must not glue onto the next one
        self._fh = open(self.path, "a", buffering=1)
        self._bar = None
        self._stream = stream or sys.stderr
        self._plain = progress and not _isatty(self._stream)
        self._total, self._done, self._last_print = total_steps, 0, 0.0
        if progress and not self._plain:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="rltpu", unit="step", file=self._stream, dynamic_ncols=True)

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record) + "\n")  # the record first: the display can never lose it
        self._fh.flush()
        os.fsync(self._fh.fileno())  # like the ledger's commits: a step the checkpoint covers keeps its line
        self._done += 1
        try:
            if self._bar is not None:
                self._bar.update(1)
                self._bar.set_postfix_str(summary(record))
            elif self._plain:
                now = time.monotonic()
                if now - self._last_print >= PLAIN_EVERY_S or self._done >= self._total or self._done == 1:
                    self._last_print = now
                    print(f"rltpu: step {record.get('step')} ({self._done}/{self._total}) {summary(record)}",
                          file=self._stream, flush=True)
        except (OSError, ValueError):  # a closed or full stderr must not end the run
            pass

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._fh.close()


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def read_metrics(path: Path) -> list[dict]:
    """Every step record; a torn last line (a crash mid-append) is reported and dropped."""
    return read_jsonl(path, "metrics.jsonl")
