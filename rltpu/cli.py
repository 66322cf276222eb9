"""``rltpu`` command line.

    rltpu train configs/quickstart.yaml [trainer.lr=3e-3 ...] [--address HOST:PORT] [--resume | --new-run]
    rltpu export RUN_DIR/checkpoint OUT_DIR          # a Hugging Face directory of the policy (LoRA: merged; --adapters: PEFT)
    rltpu tiny-checkpoint OUT_DIR --arch qwen2       # a tiny random HF checkpoint for dry runs
    rltpu plan configs/quickstart.yaml [key=value ...] [--hardware cpu] [--out DIR] [--against RUN_DIR]
    rltpu status [RUN_DIR]                           # actor table from health.json; exit 1 when unhealthy
    rltpu dashboard [RUN_DIR] [--port 8266]          # live page on 127.0.0.1, Prometheus text at /metrics
    rltpu doctor [CONFIG] [--address HOST:PORT]      # preflight: Ray, chips, TorchTPU, JAX, libtpu, ports, run dir

User errors (config, placement) print one line and exit with code 2, with no traceback. SIGTERM
stops a run like Ctrl-C (checkpoint of the last landed step, exit 143), and so does SIGHUP from a
closed terminal (exit 129; under ``nohup`` it stays ignored); a job stopped by its
health policy (an actor failed past ``health.max_restarts``) exits with 3.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# torch loads every installed device backend at ``import torch`` (entry points); torch_tpu's then
# opens libtpu in the driver, which owns no chip, and costs 3-4 s of imports (dynamo, inductor).
# Chip-owning processes import it explicitly (``rltpu.chips.backend``) when their claim says the
# chip is real. Set, not defaulted: torch writes "1" into the environment of every process that
# autoloaded, so a launcher that imported torch would otherwise pass it on to this driver.
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

from rltpu.config import ConfigError, load_config  # noqa: E402
from rltpu.observe.log import log, set_verbosity  # noqa: E402


def _fail(msg: str) -> int:
    log.error(f"rltpu: error: {msg}")
    return 2


def _one_line(err: BaseException) -> str:
    """``Type: first line`` of an error; a Ray task error is reported by its cause."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and cause is not err:
        err = cause
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__


def _hub_ids(weights: bool):
    """Hub ids in model.path, reward_model.path, task.tokenizer, task.dataset, eval.dataset -> local
    snapshot directories, before validation (rltpu.data.hub); ``weights=False``: a model's config and
    tokenizer files, not its weights (plan, doctor)."""
    def prepare(data: dict) -> dict:
        from rltpu.data.hub import resolve_ids

        return resolve_ids(data, weights=weights)
    return prepare


def preflight_real_chips(cfg, address: str | None) -> None:
    """Before Ray starts: real chips (cluster.emulated=false, or a TPU found on this host) must form a
    placement TorchTPU can run; with an embedded cluster every actor runs here, so this host must be
    able to open them too (ChipUnavailableError: one line, exit 2, nothing started)."""
    from rltpu.chips.launch import check_real_placement
    from rltpu.chips.topology import ChipTable, Role, assign_roles, trainer_processes

    table = ChipTable.build(cfg.cluster)
    if table.emulated:
        return
    roles = assign_roles(table, cfg.placement)
    check_real_placement(cfg.cluster.generation, trainer_processes(roles[Role.TRAINER]), table.chips_per_host,
                         cfg.placement.mode)
    if not address:
        from rltpu.chips.backend import ChipUnavailableError, decide
        from rltpu.control.doctor import child_env, probe_trainer_chip

        child_env(cfg, "sampler", False, strict=True)  # JAX's libtpu build is installed (rltpu.chips.libtpu)
        decide("sampler", False, cfg.backend)
        missing = probe_trainer_chip(cfg)  # in a child: the driver must not load TorchTPU itself
        if missing:
            raise ChipUnavailableError(f"trainer claimed real TPU chips but {missing}")


def _exit_now(code: int) -> None:
    """End ``rltpu train`` at once: everything is saved and closed, and the interpreter's own exit
    (library exit hooks, module teardown) is a window where a signal can no longer run a Python
    handler, so a SIGTERM there was lost (exit 0) or, after Ray reset its action, killed the
    driver (exit -15) with no line."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def cmd_train(args) -> int:
    """``rltpu train``; ends the process itself once the run is saved and closed (``_exit_now``)."""
    _exit_now(_cmd_train(args))


def _cmd_train(args) -> int:
    """One interrupt path: SIGINT, SIGTERM or SIGHUP at any point (start-up, sample, train, sync,
    checkpoint) -> ``Controller.stop_on_interrupt`` (checkpoint) -> one line, exit 130 / 143 / 129."""
    import signal

    from rltpu.control.interrupts import INTERRUPTS

    INTERRUPTS.install()  # before anything slow (imports, config): a signal now is already ours
    try:
        return _train(args, INTERRUPTS)
    except SystemExit as err:  # a library's SIGTERM handler (sys.exit(15)) got in before ours: still one line
        if err.code != signal.SIGTERM:
            raise
        INTERRUPTS.acknowledge()
        INTERRUPTS.ignore()
        log.warning("rltpu: stopped by SIGTERM during start-up")
        return 143
    except KeyboardInterrupt:  # before the controller existed
        INTERRUPTS.acknowledge()
        INTERRUPTS.ignore()
        # nothing was written yet, so the same command (with or without --resume) starts where it would have
        log.warning(f"rltpu: stopped by {INTERRUPTS.name()} during start-up, before anything ran; nothing was written, "
                    f"run the same command again")
        return INTERRUPTS.exit_code()
    finally:
        if INTERRUPTS.received or INTERRUPTS.late:  # already answered with its line: a second one is ignored
            INTERRUPTS.ignore()
        else:  # the process's last moments (interpreter and library exit hooks): a signal still gets its line
            INTERRUPTS.exit_on_signal("while exiting, after the command had ended (nothing was left to save)")


def resume_from(run_dir: Path) -> bool:
    """What ``--resume`` does with this run dir: True to load its checkpoint, False to start from
    step 0 (said in a line) when nothing was trained there yet: no checkpoint and no ledger step,
    whether start-up was stopped or the dir does not exist yet. Why not an error: a scheduler that
    restarts a preempted job passes ``--resume`` every time, the first launch included. Trained
    steps without a checkpoint raise: starting over would lose them."""
    ckpt = run_dir / "checkpoint"
    # checkpoint/, checkpoint.prev/, checkpoint.prev2/ ... (a corrupt newer one may have been moved aside)
    older = [d for d in run_dir.glob("checkpoint.prev*") if not d.name.endswith(".corrupt")]
    if any((d / "trainer_state.json").exists() for d in (ckpt, *older)):
        return True
    from rltpu.observe.ledger import effective, read_ledger

    if effective(read_ledger(run_dir / "ledger.jsonl")):
        raise ConfigError(f"--resume: no checkpoint in {ckpt} but the ledger has trained steps (restore the "
                          f"checkpoint, or start over with --new-run instead of --resume)")
    log.warning(f"rltpu: --resume: nothing trained in {run_dir} yet (no checkpoint, no ledger step); starting from "
                f"step 0")
    return False


def _train(args, interrupts) -> int:
    from rltpu.chips.backend import ChipUnavailableError
    from rltpu.chips.cluster import PlacementError
    from rltpu.chips.topology import ChipConflictError
    from rltpu.observe.health import HealthError, PhaseTimeout

    try:
        cfg = load_config(args.config, args.overrides, prepare=_hub_ids(weights=True))
        if args.run_dir:
            cfg = cfg.model_copy(update={"run_dir": args.run_dir})
        log.debug(f"rltpu: config {args.config} with {len(args.overrides)} overrides; run_dir {cfg.resolved_run_dir}")
        from rltpu.control import rundir

        rundir.check_fresh(cfg.resolved_run_dir, bool(args.resume), args.new_run)  # one run per directory
        if isinstance(args.resume, str):  # --resume PATH: that checkpoint (verified here, before Ray starts)
            from rltpu.control.checkpoints import named_checkpoint

            resume = named_checkpoint(args.resume, cfg.resolved_run_dir)
        else:
            resume = resume_from(cfg.resolved_run_dir) if args.resume else False
        preflight_real_chips(cfg, args.address or cfg.cluster.address)
        from rltpu.control.controller import Controller

        controller = Controller(cfg, address=args.address, resume=resume)  # Ray is starting in the background
        try:
            # everything is checked: take the directory (a lock held until this process ends)
            moved = rundir.claim(cfg.resolved_run_dir, bool(args.resume), args.new_run)
            if moved is not None:
                log.info(f"rltpu: --new-run: the previous run's files are in {moved}")
            if isinstance(resume, Path):  # resumed from an older checkpoint of this run: the newer ones move aside
                from rltpu.control.checkpoints import set_aside_newer

                set_aside_newer(resume, cfg.resolved_run_dir)
            interrupts.check()  # a signal swallowed during the imports above
        except BaseException:
            controller.abandon()
            raise
    except (ConfigError, ValueError, ChipUnavailableError, OSError) as err:
        return _fail(str(err) if not isinstance(err, OSError) else _one_line(err))
    controller.handle_signals = True  # re-installed after ray.init
    end = "failed"
    try:
        controller.start()
        records = controller.run()
        end = "finished"
    except KeyboardInterrupt:
        end = "stopped"
        interrupts.acknowledge()
        interrupts.ignore()  # the checkpoint is being written: a second signal must not cut it short
        line = controller.stop_on_interrupt()
        log.warning(f"rltpu: stopped by {interrupts.name()} {line}")
        return interrupts.exit_code()
    except (ConfigError, PlacementError, ChipConflictError) as err:
        return _fail(str(err))
    except ChipUnavailableError as err:  # raised in an actor's claim: Ray wraps it; report the cause's line
        return _fail(str(getattr(err, "cause", None) or err).splitlines()[0])
    except HealthError as err:
        log.error(f"rltpu: error: job stopped by its health policy: {err}")
        return 3
    except Exception as err:  # noqa: BLE001 - Ray task errors, OS errors, timeouts: one line, not a traceback
        import ray.exceptions

        if os.environ.get("RLTPU_TRACEBACK") or not isinstance(
                err, (ray.exceptions.RayError, OSError, PhaseTimeout, TimeoutError)):
            raise  # our own bug: the traceback is what a report needs
        cause = getattr(err, "cause", None)
        if isinstance(cause, ConfigError):  # a user error raised inside an actor
            return _fail(str(cause).splitlines()[0])
        log.error(f"rltpu: error: {_one_line(err)} (run dir {controller.run_dir}; RLTPU_TRACEBACK=1 for the "
                  f"traceback)")
        return 1
    finally:
        interrupts.hold()  # shutting down: a signal must not cut it short; a finished run reports it below
        controller.shutdown(end)  # keeps the handlers through ray.shutdown (placement.py)
    if controller.steps_run:
        last = records[-5:]
        mean = sum(r["reward_mean"] for r in last) / len(last)
        chips = "emulated chips" if controller.emulated else "TPU chips"
        first = controller.first_step_line()  # its time from the launch by phase (also trace.json's spans)
        print(f"rltpu: done: {controller.steps_run} steps on {chips}, last-{len(last)} mean reward {mean:.3f}; "
              f"{first + '; ' if first else ''}run dir {controller.run_dir}", flush=True)
    if interrupts.late:  # the run had finished when it came: nothing to resume, but the signal is answered
        log.warning(f"rltpu: stopped by {interrupts.late_name()} while shutting down after the last step; the run had "
                    f"finished (final checkpoint in {controller.run_dir / 'checkpoint'}; nothing to resume)")
        return interrupts.late_exit_code()
    return 0


def cmd_doctor(args) -> int:
    """One line per preflight check (rltpu.control.doctor); exit 0 when all pass, 1 when one fails."""
    try:
        cfg = load_config(args.config, args.overrides, prepare=_hub_ids(weights=False))
    except ConfigError as e:
        return _fail(str(e))
    from rltpu.control.doctor import run

    checks = run(cfg, args.address)
    for c in checks:
        print(c.line(), flush=True)
    return 0 if all(c.ok for c in checks) else 1


def cmd_plan(args) -> int:
    """Cost and rank placements for the config; nothing is started (see rltpu/plan)."""
    import json
    from pathlib import Path

    from rltpu.plan.planner import make_plan
    from rltpu.plan import report as plan_report

    try:
        cfg = load_config(args.config, args.overrides, prepare=_hub_ids(weights=False))
        hardware = args.hardware
        measured = None
        if args.against:
            from rltpu.plan.calibrate import read_run

            measured = read_run(args.against)
            if hardware is None and cfg.planner.hardware == "auto" and measured["emulated"]:
                hardware = "cpu"  # an emulated run is checked against this machine's figures
        bench = None
        if (hardware or cfg.planner.hardware) == "cpu":
            from rltpu.plan.microbench import load_or_run

            bench = load_or_run(rebench=args.rebench)
        log.debug(f"rltpu: plan: {args.config} on {hardware or cfg.planner.hardware} figures")
        plan = make_plan(cfg, hardware, bench)
        cmp = None
        if args.against:
            from rltpu.plan.calibrate import compare, format_table

            cmp = compare(plan, args.against)
        if args.write_config:
            from rltpu.plan.writer import write_config

            write_config(plan, Path(args.write_config))
    except (ConfigError, ValueError, RuntimeError) as err:
        return _fail(str(err).splitlines()[0] if str(err) else err.__class__.__name__)
    # beyond planner.DETAIL_MAX_CHIPS the JSON holds rank tables of thousands of rows: written compact
    # (json's C encoder; indenting them took most of a 6,144-chip plan's time)
    indent = 1 if plan.detailed_report else None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.md").write_text(plan_report.markdown(plan, args.top))
        (out / "plan.html").write_text(plan_report.html_page(plan, args.top))
        (out / "plan.json").write_text(json.dumps(plan.to_json() | ({"against": cmp} if cmp else {}), indent=indent,
                                                  default=str))
        (out / "ranks.csv").write_text(plan_report.ranks_csv(plan))
    if args.json:
        print(json.dumps(plan.to_json() | ({"against": cmp} if cmp else {}), indent=indent, default=str))
    elif cmp:
        print(format_table(cmp), end="")
    else:
        print(plan_report.markdown(plan, args.top), end="")
    if args.write_config:
        log.info(f"rltpu: wrote {args.write_config} ({plan.best_runnable.name})")
    if args.out:
        log.info(f"rltpu: wrote {args.out}/plan.md, plan.html, plan.json, ranks.csv")
    return 0


def cmd_export(args) -> int:
    from rltpu.models.hf.export import export_checkpoint

    try:
        summary = export_checkpoint(args.checkpoint, args.out_dir, args.shard_mb, args.adapters)
    except (ConfigError, ValueError, OSError) as err:
        return _fail(str(err).splitlines()[0] if str(err) else type(err).__name__)
    import json

    print(json.dumps(summary))
    return 0


def cmd_tiny_checkpoint(args) -> int:
    from rltpu.models.hf.tiny import run

    try:
        return run(args)
    except (ConfigError, ValueError) as err:
        return _fail(str(err))


def cmd_status(args) -> int:
    """Exit 0 healthy (or finished), 1 unhealthy, 2 no health file."""
    from rltpu.observe.health import assess, format_status, read_health

    try:
        doc = read_health(args.run_dir)
    except (OSError, ValueError) as err:
        return _fail(str(err))
    if args.json:
        import json

        print(json.dumps(doc, indent=1))
    else:
        print(format_status(doc))
    return 0 if assess(doc)[0] else 1


def cmd_dashboard(args) -> int:
    from pathlib import Path

    from rltpu.observe.dashboard import serve

    from rltpu.config import is_loopback

    if not Path(args.run_dir).is_dir():
        return _fail(f"no run directory {args.run_dir}; pass the run_dir of `rltpu train` (e.g. runs/quickstart)")
    if not is_loopback(args.host) and not args.allow_remote:
        return _fail(f"--host {args.host} is not a loopback address: anyone on the network could read the run; "
                     f"add --allow-remote to mean it (or use 127.0.0.1)")
    try:
        server = serve(args.run_dir, args.host, args.port)
    except OSError as err:
        return _fail(f"cannot serve on {args.host}:{args.port} ({err.strerror}); pick another --port")
    host, port = server.server_address[:2]
    log.info(f"rltpu: dashboard for {args.run_dir} at http://{host}:{port}/ (Ctrl-C stops)")
    try:
        server.thread.join()
    except KeyboardInterrupt:
        server.shutdown()
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``rltpu: error: ...``, exit 2), like config errors."""

    def error(self, message: str):
        self.exit(2, f"rltpu: error: {message} (see 'rltpu {self.prog.split()[-1]} --help')\n"
                  if " " in self.prog else f"rltpu: error: {message} (see 'rltpu --help')\n")


def main(argv: list[str] | None = None) -> int:
    # -q / -v before or after the command (every subcommand takes them): the level of rltpu's stderr lines
    def verbosity(default_q, default_v) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(add_help=False)
        p.add_argument("-q", "--quiet", action="store_true", default=default_q,
                       help="warnings and errors only (train: no progress display)")
        p.add_argument("-v", "--verbose", action="count", default=default_v, help="debug lines too")
        return p

    parser = _Parser(prog="rltpu", description="RL post-training on TPU chips (or emulated chips on CPU).",
                     parents=[verbosity(False, 0)])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub_add, after = sub.add_parser, verbosity(argparse.SUPPRESS, argparse.SUPPRESS)  # keeps `rltpu -q train`'s
    sub.add_parser = lambda *a, **k: sub_add(*a, parents=[after], **k)  # noqa: E731
    p = sub.add_parser("train", help="run a GRPO job from a YAML config")
    p.add_argument("config", help="YAML config (e.g. configs/quickstart.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-6")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting an embedded one")
    p.add_argument("--run-dir", default=None, help="override run_dir")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH",
                   help="continue from the newest valid <run_dir>/checkpoint, or from the checkpoint directory PATH "
                        "(an older one of this run, e.g. <run_dir>/checkpoint.prev, or another run's in a new run_dir)")
    p.add_argument("--new-run", action="store_true",
                   help="start over in a run_dir that holds a run (its files move to <run_dir>/previous-<time>/)")
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("export", help="write a run checkpoint as a Hugging Face directory")
    p.add_argument("checkpoint", help="RUN_DIR/checkpoint")
    p.add_argument("out_dir", help="directory to write (config.json, model.safetensors, tokenizer)")
    p.add_argument("--shard-mb", type=float, default=4096,
                   help="largest weight file; bigger models are split with model.safetensors.index.json")
    p.add_argument("--adapters", action="store_true",
                   help="LoRA runs: write the adapters in the PEFT format (adapter_config.json + "
                        "adapter_model.safetensors) instead of the merged model")
    p.set_defaults(func=cmd_export, overrides=[])
    from rltpu.models.hf.tiny import add_arguments

    p = sub.add_parser("tiny-checkpoint", help="write a tiny random HF checkpoint (needs transformers)")
    add_arguments(p)
    p.set_defaults(func=cmd_tiny_checkpoint, overrides=[])
    q = sub.add_parser("plan", help="rank chip placements for a config: memory, step time, why (starts nothing)")
    q.add_argument("config", help="YAML config (the same file `rltpu train` takes)")
    q.add_argument("overrides", nargs="*", help="dotted overrides, e.g. cluster.topology=4x4")
    q.add_argument("--hardware", default=None, choices=["cpu", "v4", "v5e", "v5p", "v6e", "7x"],
                   help="figures to plan with (default: planner.hardware, else cluster.generation)")
    q.add_argument("--out", default=None, help="write plan.md, plan.html and plan.json into this directory")
    q.add_argument("--json", action="store_true", help="print the plan as JSON instead of Markdown")
    q.add_argument("--write-config", default=None, help="write the best placement `rltpu train` can run as YAML")
    q.add_argument("--against", default=None, help="a finished run dir: predicted vs measured seconds per phase")
    q.add_argument("--rebench", action="store_true", help="measure this CPU again (cpu hardware only)")
    q.add_argument("--top", type=int, default=12, help="feasible candidates shown in the reports")
    q.set_defaults(func=cmd_plan)
    q = sub.add_parser("status", help="actor health table of a run (exit 1 when unhealthy)")
    q.add_argument("run_dir", nargs="?", default="runs/quickstart", help="run directory (default runs/quickstart)")
    q.add_argument("--json", action="store_true", help="print health.json instead of the table")
    q.set_defaults(func=cmd_status, overrides=[])
    q = sub.add_parser("dashboard", help="serve a run's live dashboard on 127.0.0.1")
    q.add_argument("run_dir", nargs="?", default="runs/quickstart", help="run directory (default runs/quickstart)")
    q.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    q.add_argument("--port", type=int, default=8266, help="port (0: any free one)")
    q.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --host (no authentication)")
    q.set_defaults(func=cmd_dashboard, overrides=[])
    q = sub.add_parser("doctor", help="preflight on a TPU VM or cluster: Ray, chips, TorchTPU, JAX, libtpu, ports")
    q.add_argument("config", nargs="?", default="configs/quickstart.yaml", help="the config the job will run")
    q.add_argument("overrides", nargs="*", help="key=value config overrides")
    q.add_argument("--address", default=None, help="a running Ray cluster (default: an embedded one, as train)")
    q.set_defaults(func=cmd_doctor)
    # overrides may come before or after flags (argparse alone stops collecting them at a flag)
    args, extra = parser.parse_known_args(argv)
    if isinstance(getattr(args, "resume", None), str) and "=" in args.resume and not Path(args.resume).is_dir():
        extra, args.resume = [args.resume, *extra], True  # `--resume trainer.steps=9`: an override, not a PATH
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*getattr(args, "overrides", []), *extra]
    set_verbosity(args.quiet, args.verbose)
    if args.quiet and args.command == "train":
        args.overrides = [*args.overrides, "progress=false"]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
