"""`pstrain validate`, `pstrain crd` and `pstrain convert`: the API's own subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from .convert import ConversionError, convert_tfjob
from .crd import render_crd_yaml
from .entrypoint import EntrypointError, resolve_entrypoint
from .kube_rules import kubernetes_problems
from .model import TrainingJob
from .manifest_yaml import UnreadableManifest, read_manifest_text
from .validate import Problem, load_jobs, parse_documents


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
    parser.add_argument("--kubernetes", action="store_true",
                        help="also apply the rules the operator applies on Kubernetes only "
                        "(what `pstrain run` fills in itself, such as a mounted volume for "
                        "spec.training.sparseStorage.directory)")
    args = parser.parse_args(list(argv))
    failed = False
    for path in args.files:
        jobs, problems = load_jobs(path)
        if args.check_entrypoint:
            problems += entrypoint_problems(jobs, str(path))
        if args.kubernetes:
            problems += [Problem(str(path), field, f"{message}.")
                         for j in jobs for field, message in kubernetes_problems(j)]
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


def convert_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pstrain convert",
        description="Convert a Kubeflow TFJob (kubeflow.org/v1, PS/Worker/Chief) into the "
        "equivalent TrainingJob: YAML on stdout (or in OUT), and on stderr one line per "
        "field that could not be carried over. Exits 0 when converted, 1 when the file "
        "holds something that is not such a TFJob.",
    )
    parser.add_argument("file", metavar="FILE", help="the TFJob manifest (YAML)")
    parser.add_argument("-o", "--output", metavar="OUT",
                        help="write the TrainingJob here instead of to stdout")
    args = parser.parse_args(list(argv))
    source = str(args.file)
    try:
        docs, problems = parse_documents(read_manifest_text(source), source)
    except UnreadableManifest as exc:
        docs, problems = [], [Problem(source, "", f"{exc}.")]
    except OSError as exc:
        docs, problems = [], [Problem(source, "", f"cannot read the file: "
                                                  f"{exc.strerror or exc}.")]
    jobs, notes, errors = [], [], [str(p) for p in problems]
    for i, doc in enumerate(docs):
        where = f"{source}#{i + 1}" if len(docs) > 1 else source
        try:
            converted = convert_tfjob(doc)
        except ConversionError as exc:
            errors += [f"{where}: {e}" for e in exc.errors]
            continue
        jobs.append(converted.job)
        notes += [f"{where}: {n}" for n in converted.notes]
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    text = yaml.safe_dump_all(jobs, sort_keys=False, width=100)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    if notes:
        print("\n".join(notes), file=sys.stderr)
    return 0
