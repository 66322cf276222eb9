"""Append-only JSON-lines files that survive a crash mid-append (``ledger.jsonl``, ``metrics.jsonl``).

A process killed while appending leaves a last line without its newline, or a line cut short.
Readers drop such a torn *last* line and say so (one line on stderr); a bad line anywhere else is
real corruption and raises. Before appending, a writer cuts a torn tail off, so the next line
starts on a line of its own instead of being glued to half a record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rltpu.observe.log import log


def read_jsonl(path: Path, what: str | None = None) -> list[dict]:
    """Every record of ``path`` ([] when missing); a torn last line is reported and dropped."""
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if i >= len(lines) - 2 and all(not x.strip() for x in lines[i + 1:]):
                log.warning(f"rltpu: {what or path.name}: dropped a torn last line ({len(line)} bytes, a crash "
                            f"mid-append): {line[:60].decode('utf-8', 'replace')!r}")
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON (corrupt file, not a torn tail)") from None
    return out


def repair_tail(path: Path) -> int:
    """Cut a torn last line (no newline, or not JSON) off ``path`` before appending; bytes cut."""
    path = Path(path)
    if not path.exists():
        return 0
    raw = path.read_bytes()
    keep = len(raw)
    if raw and not raw.endswith(b"\n"):
        keep = raw.rfind(b"\n") + 1  # the unterminated rest is a torn append, unless it is whole
        try:
            json.loads(raw[keep:])
            with open(path, "ab") as f:
                f.write(b"\n")
            return 0
        except ValueError:
            pass
    else:
        body = raw.rstrip(b"\n")
        start = body.rfind(b"\n") + 1
        try:
            if body[start:].strip():
                json.loads(body[start:])
        except ValueError:
            keep = start
    if keep == len(raw):
        return 0
    log.warning(f"rltpu: {path.name}: dropped a torn last line ({len(raw) - keep} bytes, a crash mid-append)")
    with open(path, "r+b") as f:
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return len(raw) - keep


def append_durable(path: Path, doc: dict) -> None:
    """One line, written whole and fsynced: a committed record survives power loss."""
    data = (json.dumps(doc) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
