"""The `pstrain` command line.

Each subcommand lives with the component that owns it and is imported only when run:
the operator image has no torch, so `pstrain operator` must never import the runtime.
A component registers a subcommand as `"module:function"` in SUBCOMMANDS; the function
takes the argv tail and returns an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from . import __version__

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("pstrain_api.cli_commands:validate_main", "Validate TrainingJob manifests offline."),
    "crd": ("pstrain_api.cli_commands:crd_main", "Print the TrainingJob CustomResourceDefinition."),
    "convert": ("pstrain_api.cli_commands:convert_main", "Convert a Kubeflow TFJob (kubeflow.org/v1) into a TrainingJob."),
    "run": ("pstrain_runtime.local.cli:run_main", "Run a TrainingJob on this machine as processes."),
    "scale": ("pstrain_runtime.local.control:scale_main", "Change the worker count of a job `pstrain run` is running."),
    "replica": ("pstrain_runtime.replica:replica_main", "Run one replica (PS or worker) from the cluster-spec environment."),
    "export": ("pstrain_runtime.export:export_main", "Export a checkpoint for plain PyTorch or serving (safetensors)."),
    "operator": ("pstrain_operator.main:operator_main", "Run the Kubernetes operator."),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pstrain",
        description="Parameter-server training on Kubernetes, and on one machine.",
    )
    parser.add_argument("--version", action="version", version=f"pstrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if not args:
        parser.print_help()
        return 2
    if args[0] not in SUBCOMMANDS:
        parser.parse_args(args)  # --help, --version, or an "invalid choice" error
        return 2
    target, _ = SUBCOMMANDS[args[0]]
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(
            f"pstrain {args[0]}: this installation lacks {exc.name!r}, which the command "
            "needs.",
            file=sys.stderr,
        )
        return 2
    return int(getattr(module, func_name)(args[1:]) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
