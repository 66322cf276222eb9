"""``rltpu`` command line.

    rltpu train configs/quickstart.yaml [trainer.lr=3e-3 ...] [--address HOST:PORT] [--resume]

User errors (config, placement) print one line and exit with code 2, with no traceback.
"""

from __future__ import annotations

import argparse
import sys

from rltpu.config import ConfigError, load_config


def _fail(msg: str) -> int:
    print(f"rltpu: error: {msg}", file=sys.stderr)
    return 2


def cmd_train(args) -> int:
    from rltpu.cluster import PlacementError
    from rltpu.topology import ChipConflictError

    try:
        cfg = load_config(args.config, args.overrides)
        if args.run_dir:
            cfg = cfg.model_copy(update={"run_dir": args.run_dir})
        from rltpu.controller import Controller

        controller = Controller(cfg, address=args.address, resume=args.resume)
    except (ConfigError, ValueError) as err:
        return _fail(str(err))
    try:
        controller.start()
        records = controller.run()
    except (ConfigError, PlacementError, ChipConflictError) as err:
        return _fail(str(err))
    except KeyboardInterrupt:
        print(f"rltpu: stopped; checkpoint and metrics are in {controller.run_dir}", file=sys.stderr)
        return 130
    finally:
        controller.shutdown()
    last = records[-5:]
    if last:
        mean = sum(r["reward_mean"] for r in last) / len(last)
        print(f"rltpu: done: {len(records)} steps, last-{len(last)} mean reward {mean:.3f}; run dir {controller.run_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rltpu", description="RL post-training on TPU chips (or emulated chips on CPU).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run a GRPO job from a YAML config")
    p.add_argument("config", help="YAML config (e.g. configs/quickstart.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-6")
    p.add_argument("--address", default=None, help="join this Ray cluster instead of starting an embedded one")
    p.add_argument("--run-dir", default=None, help="override run_dir")
    p.add_argument("--resume", action="store_true", help="continue from <run_dir>/checkpoint")
    p.set_defaults(func=cmd_train)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
