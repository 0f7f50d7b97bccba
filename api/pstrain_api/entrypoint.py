"""Resolving `spec.training.entrypoint` ('module:function') to the function, without
calling it. Shared by the runtime (which then calls it) and `pstrain validate
--check-entrypoint` (which only imports). Imports no torch itself.

An entry point that cannot be resolved is a configuration error: the replica exits with
`constants.EXIT_CONFIGURATION_ERROR`, and the restart policy fails the job at once rather than
restarting a replica that can never start.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .quote import describe


class EntrypointError(ValueError):
    """The entry point names no importable module or no function in it."""


def resolve_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """Import the module of `entrypoint` and return its function; EntrypointError with a
    sentence naming the field, the value and the cause (one line) otherwise."""
    module_name, sep, func_name = entrypoint.partition(":")
    where = f"spec.training.entrypoint is {entrypoint!r}"
    if not sep or not module_name or not func_name:
        raise EntrypointError(f"{where}; it must be module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may raise anything while importing
        raise EntrypointError(f"{where}; module {module_name!r} cannot be imported: "
                              f"{describe(exc)}") from exc
    func = getattr(module, func_name, None)
    if not callable(func):
        raise EntrypointError(f"{where}; {module_name} has no function {func_name!r}")
    return func  # type: ignore[no-any-return]
