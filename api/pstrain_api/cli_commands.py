"""`pstrain validate` and `pstrain crd`: the API's own subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .crd import render_crd_yaml
from .entrypoint import EntrypointError, resolve_entrypoint
from .model import TrainingJob
from .validate import Problem, load_jobs


def validate_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pstrain validate",
        description="Validate TrainingJob manifests offline. Exits 0 when every file is "
        "valid, 1 otherwise, printing each problem with its field path.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML manifests")
    parser.add_argument("--check-entrypoint", action="store_true",
                        help="also import each job's spec.training.entrypoint and check "
                        "that it names a function (nothing is called); the module must be "
                        "importable here as in the replicas")
    args = parser.parse_args(list(argv))
    failed = False
    for path in args.files:
        jobs, problems = load_jobs(path)
        if args.check_entrypoint:
            problems += entrypoint_problems(jobs, str(path))
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            failed = True
        else:
            names = ", ".join(f"{j.namespace}/{j.name}" for j in jobs)
            print(f"{path}: valid ({names})")
    return 1 if failed else 0


def entrypoint_problems(jobs: Sequence[TrainingJob], source: str) -> list[Problem]:
    """A problem for each job whose entry point cannot be imported (none is called)."""
    out = []
    for job in jobs:
        try:
            resolve_entrypoint(job.spec.training.entrypoint)
        except EntrypointError as exc:
            out.append(Problem(source, "spec.training.entrypoint", f"{exc}."))
    return out


def crd_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pstrain crd",
        description="Print the TrainingJob CustomResourceDefinition generated from the "
        "API models.",
    )
    parser.parse_args(list(argv))
    sys.stdout.write(render_crd_yaml())
    return 0
