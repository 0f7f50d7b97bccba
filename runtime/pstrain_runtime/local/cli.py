"""`pstrain run FILE`: parse arguments, load the manifest, run, print the result."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence

from pstrain_api.validate import InvalidManifest, load_job

from ..failure import ConfigurationError
from .processes import DEFAULT_REPLICA_COMMAND
from .runner import RunOptions, run_job


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be greater than 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pstrain run",
        description="Run a TrainingJob on this machine as processes: parameter servers "
        "first, then (once they serve) the workers, then the chief. Exits 0 when the job "
        "succeeds, 1 when it fails or the manifest is invalid, 2 for a bad command line, "
        "130 on Ctrl-C (SIGINT), 143 on SIGTERM.",
    )
    parser.add_argument("file", metavar="FILE", help="TrainingJob manifest (YAML)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON summary line on stdout at the end; "
                        "everything else goes to stderr")
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="no progress bar and no replica output; only the runner's "
                        "notices, evals, checkpoints, restores and the result")
    parser.add_argument("--timeout", type=_positive, metavar="SECONDS",
                        help="fail the job after this many seconds (the tighter of this "
                        "and spec.runPolicy.activeDeadlineSeconds applies)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="write checkpoints here (overrides "
                        "spec.training.checkpoint.directory); without either, a temporary "
                        "directory is used for the run, removed at exit unless the job "
                        "stops early and can resume from it")
    parser.add_argument("--health-timeout", type=_positive, default=60.0, metavar="SECONDS",
                        help="how long a parameter server may take to report SERVING "
                        "(default: %(default)s)")
    parser.add_argument("--replica-command", metavar="COMMAND",
                        default=shlex.join(DEFAULT_REPLICA_COMMAND),
                        help="the command that starts one replica, which reads its role "
                        "from the environment (default: %(default)s)")
    return parser


def run_main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        job = load_job(args.file)
    except InvalidManifest as exc:
        for problem in exc.problems:
            print(problem, file=sys.stderr)
        return 1
    command = shlex.split(args.replica_command)
    if not command:
        print("pstrain run: --replica-command is empty; it must name a program.",
              file=sys.stderr)
        return 2
    options = RunOptions(
        json=args.json,
        quiet=args.quiet,
        timeout=args.timeout,
        checkpoint_dir=args.checkpoint_dir,
        replica_command=command,
        health_timeout=args.health_timeout,
        manifest=args.file,
    )
    try:
        result = run_job(job, options)
        if args.json:
            sys.stdout.write(json.dumps(result.summary, separators=(",", ":")) + "\n")
            sys.stdout.flush()
    except ConfigurationError as exc:
        print(f"pstrain run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C before the runner's own handler was installed (or after it was
        # removed): run_job's clean-up has already killed whatever it had started.
        print("pstrain run: interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Whoever read our output went away (`pstrain run job.yaml | head`): run_job's
        # clean-up has stopped every replica. Exit like a program killed by SIGPIPE,
        # with stdout pointed at /dev/null so the interpreter's final flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    return result.exit_code
