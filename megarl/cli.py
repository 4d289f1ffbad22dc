"""The ``megarl`` command line: thin subcommands over library entry points.

Each subcommand is one function registered with ``@subcommand``; a subcommand that reads a
config gets ``--config FILE`` and trailing ``key=value`` overrides. A bad config exits with
status 2 and the ``ConfigError`` message on stderr, no traceback. Heavy modules (the
controller, torch) are imported lazily so ``megarl config`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import Callable, Optional, Sequence

from megarl.config import ConfigError, load_config, to_yaml
from megarl.config.preflight import preflight
from megarl.rollout import auth as rollout_auth

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's status for a command ended by SIGINT

_Handler = Callable[[argparse.Namespace], int]
_Flags = Callable[[argparse.ArgumentParser], None]
_SUBCOMMANDS: list[tuple[str, str, bool, _Handler, Optional[_Flags]]] = []


class _Abort(Exception):
    """A user-facing failure: message to stderr, exit status 2."""


def subcommand(name: str, help: str, config: bool = True,
               flags: Optional[_Flags] = None) -> Callable[[_Handler], _Handler]:
    """Register ``fn(args) -> exit status`` as ``megarl <name>``; ``flags(parser)`` adds the
    subcommand's own options."""
    def register(fn: _Handler) -> _Handler:
        _SUBCOMMANDS.append((name, help, config, fn, flags))
        return fn
    return register


def _config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--get", metavar="KEY",
                        help="print only this dotted key's value (as launch scripts read one)")


@subcommand("config", "print the resolved, validated config as YAML", flags=_config_flags)
def _config(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.get:
        from omegaconf import OmegaConf

        value = OmegaConf.select(cfg, args.get, default=_Abort)
        if value is _Abort:
            raise _Abort(f"megarl config --get: {args.get} is not a config key")
        print(to_yaml(value).strip() if OmegaConf.is_config(value) else value)
        return 0
    print(to_yaml(cfg), end="")
    return 0


def _train_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="print the run's plan (placement, server commands, weight-update "
                             "ranks, buckets, memory per GPU) and exit; starts nothing")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, metavar="GIB",
                        help="memory of one device for the dry run's fit check (default 80); "
                             "a plan over it exits 2")


@subcommand("train", "train (trainer.val_only=True only validates)", flags=_train_flags)
def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        # No file checks: a dry run plans, often on a laptop, a run whose model and data
        # live on the cluster.
        return _dry_run(cfg, args.gpu_memory_gib)
    rollout_auth.establish(cfg)  # before any server or worker: they inherit it
    preflight(cfg)  # every rank, before Ray or a torchrun rendezvous: files fail here
    if cfg.trainer.launcher == "torchrun":
        # Every process of the torchrun world lands here; rank 0 drives, the others serve it.
        from megarl.cluster import torchrun

        return torchrun.main(cfg, lambda life: _driver("train").run(cfg, life=life))
    _driver("train").run(cfg)
    return 0


@subcommand("validate", "run validation only (same as train with trainer.val_only=True)")
def _validate(args: argparse.Namespace) -> int:
    # Validate as val_only so a config with no data.val_files fails here, not in the driver.
    cfg = load_config(args.config, [*args.overrides, "trainer.val_only=True"])
    rollout_auth.establish(cfg)
    preflight(cfg)
    if cfg.trainer.launcher == "torchrun":
        from megarl.cluster import torchrun

        return torchrun.main(cfg, lambda life: _driver("validate").run(cfg, val_only=True,
                                                                        life=life))
    _driver("validate").run(cfg, val_only=True)
    return 0


def _dry_run(cfg, gpu_memory_gib: float) -> int:
    """Plan without starting anything; under torchrun every rank plans, rank 0 prints."""
    from megarl.controller.dryrun import format_plan, plan_run

    text = format_plan(plan_run(cfg, gpu_memory_gib=gpu_memory_gib))
    if os.environ.get("RANK", "0") == "0":
        print(text, end="")
    return 0


def _driver(command: str):
    module = "megarl.controller.driver"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name not in (module, module.rpartition(".")[0]):
            raise  # the driver exists but one of its own imports is missing
        raise _Abort(f"megarl {command}: the controller is not built yet") from None


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from-run", metavar="DIR",
                        help="a finished run's output directory (or its timeline.json) to take "
                             "task durations from; without it a short profiling run of the "
                             "config is started first")
    parser.add_argument("--profile-steps", type=int, default=8, metavar="N",
                        help="steps of the profiling run (default 8; the first 2 are warm-up)")
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, metavar="GIB",
                        help="memory of one device for each layout's fit check (default 80)")
    parser.add_argument("--out", metavar="FILE",
                        help="also write the best layout's overrides here, one per line")
    parser.add_argument("--scaling", choices=("auto", "linear", "none"), default="auto",
                        help="how a data-parallel task's time follows its group's devices: "
                             "linear (accelerators), none (CPU devices sharing a host's cores); "
                             "auto (default) picks by trainer.device")


@subcommand("plan", "rank task-group layouts (groups, device shares, generate-ahead) by "
            "simulated step time from measured task durations", flags=_plan_flags)
def _plan(args: argparse.Namespace) -> int:
    import subprocess
    import tempfile
    from pathlib import Path

    from megarl.controller import planner

    cfg = load_config(args.config, args.overrides)  # a bad config fails before any work
    if args.profile_steps < 3:
        raise _Abort("megarl plan: --profile-steps must be at least 3 (2 are warm-up)")
    if args.out and not Path(args.out).resolve().parent.is_dir():
        raise _Abort(f"megarl plan: --out {args.out}: no such directory")
    source = args.from_run
    if source is None:
        t = cfg.trainer
        name = f"{t.experiment_name}-plan-profile"
        n = args.profile_steps
        cmd = [sys.executable, "-m", "megarl.cli", "train",
               *(["--config", args.config] if args.config else []), *args.overrides,
               f"trainer.total_training_steps={n}", "trainer.save_freq=-1",
               "trainer.test_freq=-1", "trainer.val_before_train=False",
               f"trainer.timeline_freq={n}", f"trainer.experiment_name={name}",
               "trainer.resume_mode=disable"]
        logging.getLogger("megarl.plan").info("profiling run: %d steps of the config as given",
                                              n)
        if subprocess.run(cmd).returncode != 0:
            raise _Abort("megarl plan: the profiling run failed (its log is above)")
        source = str(Path(t.default_local_dir) / t.project_name / name)
    m = planner.measure(source)
    scaling = None if args.scaling == "auto" else args.scaling
    cands = planner.plan(args.config, args.overrides, m, args.gpu_memory_gib, scaling=scaling)
    print(planner.format_table(cands, m), end="")
    if args.out:
        out = Path(args.out)
        with tempfile.NamedTemporaryFile("w", dir=out.resolve().parent, delete=False) as f:
            f.write("\n".join(cands[0].overrides()) + "\n")
        os.replace(f.name, out)
    return 0


@subcommand("convert", "checkpoint conversion: `megarl convert {hf2mcore,mcore2hf,reshard} "
            "...` (each with --dry-run; see `megarl convert <name> --help`)", config=False)
def _convert(args: argparse.Namespace) -> int:
    from megarl.convert.cli import SUBCOMMANDS

    listing = "\n".join(f"  {name:<10} {text}" for name, (_, text) in SUBCOMMANDS.items())
    if not args.rest or args.rest[0] not in SUBCOMMANDS:
        raise _Abort(f"megarl convert: first argument must be one of {list(SUBCOMMANDS)}:\n"
                     f"{listing}")
    main_fn = SUBCOMMANDS[args.rest[0]][0]
    return main_fn(args.rest[1:], prog=f"megarl convert {args.rest[0]}")


@subcommand("make-tiny-model", "make a tiny HF model directory locally (random weights, "
            "local tokenizer); flags as tools/make_tiny_model.py", config=False)
def _make_tiny(args: argparse.Namespace) -> int:
    from megarl.utils.tiny_model import main as tiny_main

    tiny_main(args.rest)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl", description="Asynchronous RL post-training on Megatron-core + SGLang.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, takes_config, handler, flags in _SUBCOMMANDS:
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if takes_config:
            sub.add_argument("--config", "-c", metavar="FILE",
                             help="YAML config (default: the schema defaults)")
            sub.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                             help="overrides, e.g. trainer.nnodes=2 +trainer.val_only=True")
        else:
            sub.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS")
        if flags is not None:
            flags(sub)
        sub.set_defaults(handler=handler)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``megarl``; returns the exit status (0, or 2 for a bad config)."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as err:
        # One line, whatever the message quotes (a value, a library's reason): easy to grep.
        text = " ".join(str(err).split("\n"))
        print(f"megarl {args.command}: {text}", file=sys.stderr)
        return EXIT_USAGE
    except _Abort as err:
        print(err, file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        # Ctrl-C (or SIGINT from a scheduler): the run's workers and engines were closed on
        # the way out; a traceback through asyncio says nothing more than this line.
        print(f"megarl {args.command}: interrupted; a later `megarl {args.command}` with the "
              "same trainer.default_local_dir resumes from its last checkpoint",
              file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
