"""Per-step metrics: one JSON line per step in ``metrics.jsonl``, and the progress bar."""

from __future__ import annotations

import json
import sys
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: Path, total_steps: int, progress: bool):
        self.path = Path(path)
        self._fh = open(self.path, "a", buffering=1)
        self._bar = None
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, desc="rltpu", unit="step", file=sys.stderr, dynamic_ncols=True)

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record) + "\n")
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix_str(
                f"reward={record['reward_mean']:.3f} sample={record['sample_s']:.2f}s "
                f"train={record['train_s']:.2f}s sync={record['sync_s']:.2f}s"
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._fh.close()


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
