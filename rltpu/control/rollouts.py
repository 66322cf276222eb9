"""What the samplers are handed: prompts drawn with their ledger ids, and (async mode) the rollouts
submitted for future steps.

Both exist so that any stop or failure knows exactly which prompts a step trained on (the ledger)
and which were drawn but never trained on (rewound into the data cursor): none lost, none replayed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rltpu.observe.ledger import Ledger


class PromptDraws:
    """``data.next_batch`` one prompt at a time, remembering each one's (epoch, position, id) until
    the step's batch reaches the trainers (``commit``)."""

    def __init__(self, data, ledger: Ledger):
        self.data, self.ledger = data, ledger
        self.pending: list[str] = []
        self.initial = data.state_dict()  # where a trainer restart with no checkpoint rewinds to

    def draw(self, n: int) -> list[dict]:
        out = []
        for _ in range(n):
            (ex,) = self.data.next_batch(1)
            c = self.data.cursor
            self.pending.append(f"{c.epoch}:{c.position - 1}:{ex.get('id', '?')}")
            out.append(ex)
        return out

    def commit(self, step: int, version: int, behaviour_version: int | None = None) -> None:
        """Called when a step's batch is handed to the trainers (its update will land)."""
        self.ledger.commit(step, self.pending, version, behaviour_version)
        self.pending = []

    def rewind(self, state: dict) -> None:
        """Put the cursor back (the drawn prompts were never trained on)."""
        self.data.load_state_dict(state)
        self.pending = []


@dataclass
class Rollout:
    """Prompts handed to the samplers for one future step (async mode): what a rewind needs."""

    step: int  # the step that will train on it
    data_before: dict  # the data cursor before its prompts were drawn
    drawn: list[str]  # ledger ids of its prompts
    examples: list[dict]
    shards: list
    seed: int
    refs: dict = field(default_factory=dict)  # sampler rank -> (handle, ObjectRef)


class RolloutQueue:
    """Async mode (``placement.staleness`` s > 0): rollouts submitted for steps t+1..t+s while step
    t trains, the one popped for the current step, and the cursor while one is being drawn."""

    def __init__(self):
        self.inflight: deque[Rollout] = deque()
        self.current: Rollout | None = None  # popped for this step, not yet committed
        self.submitting: dict | None = None  # the cursor while a rollout's prompts are drawn

    def last_step(self, default: int) -> int:
        return self.inflight[-1].step if self.inflight else default

    def untrained_data_state(self, data) -> dict:
        """The data cursor a resume must restart from: before the oldest rollout not yet trained on,
        so in-flight prompts are drawn again (none lost) and trained ones are not (none replayed)."""
        if self.current is not None:
            return self.current.data_before
        if self.inflight:
            return self.inflight[0].data_before
        return self.submitting or data.state_dict()

    def prompts_in_flight(self) -> list[str]:
        return [p for ro in ([self.current] if self.current else []) + list(self.inflight) for p in ro.drawn]

    def drop(self, data) -> dict:
        """Forget every untrained rollout (after a failure); returns the cursor to rewind to."""
        state = self.untrained_data_state(data)
        self.inflight.clear()
        self.current = self.submitting = None
        return state
