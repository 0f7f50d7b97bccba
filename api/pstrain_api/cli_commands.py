"""`pstrain validate` and `pstrain crd`: the API's own subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .crd import render_crd_yaml
from .validate import load_jobs


def validate_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pstrain validate",
        description="Validate TrainingJob manifests offline. Exits 0 when every file is "
        "valid, 1 otherwise, printing each problem with its field path.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE", help="YAML manifests")
    args = parser.parse_args(list(argv))
    failed = False
    for path in args.files:
        jobs, problems = load_jobs(path)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            failed = True
        else:
            names = ", ".join(f"{j.namespace}/{j.name}" for j in jobs)
            print(f"{path}: valid ({names})")
    return 1 if failed else 0


def crd_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pstrain crd",
        description="Print the TrainingJob CustomResourceDefinition generated from the "
        "API models.",
    )
    parser.parse_args(list(argv))
    sys.stdout.write(render_crd_yaml())
    return 0
