"""rltpu's stderr lines go through ``logging``: the same text at the default level, ``-q`` keeps only
warnings and errors, ``-v`` adds debug lines; the flags work before or after the command."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {k: v for k, v in os.environ.items() if k != "RLTPU_LOG_LEVEL"}


def _plan(tmp_path, before=(), after=()):
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", *before, "plan", "configs/quickstart.yaml",
                          "--out", str(tmp_path), *after], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stderr.splitlines()


def test_levels(tmp_path):
    wrote = f"rltpu: wrote {tmp_path}/plan.md, plan.html, plan.json, ranks.csv"
    assert _plan(tmp_path) == [wrote]  # the default: the line as it always was, nothing else
    assert _plan(tmp_path, before=["-q"]) == [] and _plan(tmp_path, after=["--quiet"]) == []
    verbose = _plan(tmp_path, after=["-v"])
    assert verbose[-1] == wrote and verbose[0] == "rltpu: plan: configs/quickstart.yaml on auto figures"
    res = subprocess.run([sys.executable, "-m", "rltpu.cli", "-q", "train", "configs/quickstart.yaml",
                          "trainer.lrr=1"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr == ("rltpu: error: unknown config key 'trainer.lrr'; did you mean "
                                                  "'trainer.lr'? (docs/config.md lists every key)\n")


def test_module_lines_go_through_child_loggers_of_rltpu(capsys, monkeypatch):
    """The driver's modules log through ``rltpu.<package>.<module>``: the ``rltpu`` handler prints them as
    they always were, ``-q`` drops their info lines and keeps warnings, and a group can be caught alone."""
    import logging

    from rltpu.control import supervisor
    from rltpu.data import hub
    from rltpu.observe.log import log, set_verbosity

    monkeypatch.setenv("RLTPU_LOG_LEVEL", "INFO")  # set_verbosity exports the level: restored afterwards
    before = log.level
    assert supervisor.logger.name == "rltpu.control.supervisor" and hub.logger.name == "rltpu.data.hub"
    caught: list[str] = []
    group = logging.getLogger("rltpu.control")
    handler = logging.Handler()
    handler.emit = lambda record: caught.append(record.getMessage())
    group.addHandler(handler)
    try:
        set_verbosity()
        hub._log("rltpu: task.dataset org/x -> /cache/x")
        supervisor.logger.warning("rltpu: health: trainer-0 died: test")
        assert capsys.readouterr().err == "rltpu: task.dataset org/x -> /cache/x\nrltpu: health: trainer-0 died: test\n"
        set_verbosity(quiet=True)
        hub._log("rltpu: task.dataset org/x -> /cache/x")
        supervisor.logger.warning("rltpu: health: trainer-0 died: test")
        assert capsys.readouterr().err == "rltpu: health: trainer-0 died: test\n"
        assert caught == ["rltpu: health: trainer-0 died: test"] * 2  # the control group alone, not data's line
    finally:
        group.removeHandler(handler)
        log.setLevel(before)  # setLevel, not an attribute write: it clears the children's cached levels


def test_no_stderr_prints_left_in_the_packages():
    """Every stderr line of rltpu/, actors/ and learner/ goes through logging, but the signal handler's
    (logging takes locks a signal can interrupt: rltpu.control.interrupts prints)."""
    import ast

    left = []
    for pkg in ("rltpu", "actors", "learner"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print" and any(
                        k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in node.keywords):
                    left.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert [p.split(":")[0] for p in left] == ["rltpu/control/interrupts.py"], left
