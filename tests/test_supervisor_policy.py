"""The supervisor's policy (``plan_recovery``): failed actors and restart counts -> actions, by table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rltpu.control.supervisor import REPLACE, RESTART_TRAINERS, STOP, Action, plan_recovery

DIED = "died (ActorDiedError: gone)"
HUNG = "hung in sampling for 700s > deadline 600s"

CASES = [
    # failed, restarts so far, max_restarts, trainer_group -> actions
    ({}, {}, 3, False, []),
    ({"sampler-1": DIED}, {}, 3, False, [Action(REPLACE, ("sampler-1",))]),
    ({"sampler-0": HUNG, "reward-0": DIED}, {"sampler-0": 2}, 3, False,
     [Action(REPLACE, ("sampler-0", "reward-0"))]),
    ({"trainer-1": DIED}, {}, 3, False, [Action(RESTART_TRAINERS, ("trainer-1",), f"trainer-1: {DIED}")]),
    # a trainer and a sampler at once: the group restarts, then the sampler is replaced
    ({"sampler-0": DIED, "trainer-0": HUNG}, {}, 3, False,
     [Action(RESTART_TRAINERS, ("trainer-0",), f"trainer-0: {HUNG}"), Action(REPLACE, ("sampler-0",))]),
    # a broken collective names no trainer: the group restarts, counted on trainer-0
    ({}, {}, 3, True, [Action(RESTART_TRAINERS, ("trainer-0",), "trainer-0: the trainer group failed")]),
    # one more failure than allowed stops the job, whatever else failed
    ({"sampler-1": DIED, "sampler-0": DIED}, {"sampler-0": 3}, 3, False,
     [Action(STOP, ("sampler-0",), f"sampler-0 failed 4 times (last: {DIED}); health.max_restarts=3 reached")]),
    ({}, {"trainer-0": 1}, 1, True,
     [Action(STOP, ("trainer-0",), "trainer-0 failed 2 times (last: the trainer group failed); "
                                   "health.max_restarts=1 reached")]),
    ({"sampler-0": DIED}, {}, 0, False,
     [Action(STOP, ("sampler-0",), f"sampler-0 failed 1 times (last: {DIED}); health.max_restarts=0 reached")]),
]


@pytest.mark.parametrize("failed,restarts,max_restarts,group,expected", CASES)
def test_policy_table(failed, restarts, max_restarts, group, expected):
    assert plan_recovery(failed, restarts, max_restarts, group) == expected


def test_the_supervisor_module_does_not_know_the_controller():
    """Its collaborators are explicit (placement, weight handoff, the run's callables), not the controller."""
    import inspect

    from rltpu.control.supervisor import Supervisor

    src = (Path(__file__).resolve().parents[1] / "rltpu" / "control" / "supervisor.py").read_text()
    imported = {n.module for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.endswith("controller") for m in imported)
    assert "ctl" not in src.replace("ctrl", "")
    assert list(inspect.signature(Supervisor).parameters) == ["cfg", "run_dir", "placement", "job"]
