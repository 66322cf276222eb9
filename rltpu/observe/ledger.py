"""The prompt ledger: which prompts each committed step trained on (``ledger.jsonl``).

A line ``{"step": k, "prompts": ["<epoch>:<position>:<id>", ...]}`` (``position`` in the epoch's
shuffled order, ``id`` the dataset row) is written when step k's batch reaches
the trainers. A rewind (trainer-group restart from a checkpoint, or a resume from an older
checkpoint) appends ``{"rollback_to": k, "why": ...}``: steps after k are void and are drawn
again. ``effective`` replays those rules, so a test can prove that across kills and resumes no
prompt was skipped (positions are contiguous) and none was replayed (each id once per epoch).
"""

from __future__ import annotations

from pathlib import Path

from rltpu.observe.jsonl import append_durable, read_jsonl, repair_tail


class Ledger:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._repaired = False

    def _append(self, doc: dict) -> None:
        """Commits are fsynced (a step the checkpoint covers is on disk); a torn tail left by a crash
        is cut off first, so the new line starts clean."""
        if not self._repaired:
            repair_tail(self.path)
            self._repaired = True
        append_durable(self.path, doc)

    def commit(self, step: int, prompts: list[str], version: int, behaviour_version: int | None = None) -> None:
        """``version``: the policy the update starts from; ``behaviour_version``: the (oldest) weights
        that sampled the batch, behind ``version`` by the step's staleness in async mode."""
        doc = {"step": step, "weight_version": version, "prompts": prompts}
        if behaviour_version is not None:
            doc["behaviour_version"] = behaviour_version
        self._append(doc)

    def rollback(self, to_step: int, why: str) -> None:
        """Void every committed step after ``to_step`` (no-op when none is)."""
        if any(s > to_step for s in effective(read_ledger(self.path))):
            self._append({"rollback_to": to_step, "why": why})


def read_ledger(path: Path) -> list[dict]:
    """Every line ([] when missing); a torn last line (a crash mid-append) is reported and dropped."""
    return read_jsonl(path, "ledger.jsonl")


def effective(lines: list[dict]) -> dict[int, list[str]]:
    """Step -> prompt ids after applying rollbacks (a re-committed step replaces a voided one)."""
    steps: dict[int, list[str]] = {}
    for doc in lines:
        if "rollback_to" in doc:
            steps = {k: v for k, v in steps.items() if k <= doc["rollback_to"]}
        else:
            if doc["step"] in steps:
                raise ValueError(f"ledger: step {doc['step']} committed twice without a rollback")
            steps[doc["step"]] = doc["prompts"]
    return dict(sorted(steps.items()))


def check(lines: list[dict], steps: int, per_step: int) -> list[str]:
    """Problems with an effective ledger of ``steps`` steps of ``per_step`` prompts (empty: none)."""
    eff = effective(lines)
    problems = []
    if sorted(eff) != list(range(1, steps + 1)):
        problems.append(f"steps {sorted(set(range(1, steps + 1)) - set(eff))} missing, "
                        f"{sorted(set(eff) - set(range(1, steps + 1)))} extra")
    ids = [p for k in sorted(eff) for p in eff[k]]
    if len(ids) != len(set(ids)):
        dup = sorted({p for p in ids if ids.count(p) > 1})[:5]
        problems.append(f"prompts replayed: {dup}")
    cursor = [tuple(int(x) for x in p.split(":")[:2]) for p in ids]
    for (e0, p0), (e1, p1) in zip(cursor, cursor[1:]):
        if (e1, p1) != (e0, p0 + 1) and (e1, p1) != (e0 + 1, 0):
            problems.append(f"prompts skipped between epoch {e0} position {p0} and epoch {e1} position {p1}")
            break
    if cursor and cursor[0] != (0, 0):
        problems.append(f"the first prompt is at epoch/position {cursor[0]}, not (0, 0)")
    if any(len(v) != per_step for v in eff.values()):
        problems.append(f"a step without {per_step} prompts: {[k for k, v in eff.items() if len(v) != per_step]}")
    return problems
