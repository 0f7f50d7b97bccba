"""What a local run checks and says before it starts its first process.

- The entry point (`entrypoint_problem`): a value that names no module, or no function
  in a module's source, is refused in one line, before any replica starts, instead of
  every worker failing on it in turn. Nothing of the user's module is run: it is found
  on the replicas' import path (this directory first, as `python -m` puts it) and its
  source is parsed, not imported. What only running the module can show (an import
  inside it that fails, a function that raises) is still each replica's configuration
  error.
- The notices that open a run (`startup_notices`): the replicas and their addresses,
  memory and core warnings, run-policy fields that do not apply here, GPUs, where
  checkpoints go. The measurements (memory, cores) come in as arguments: pure text.
- Whether the job can be scaled while it runs (`may_scale`) and the hint that says how.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from pstrain_api import constants as c
from pstrain_api.cluster import ClusterSpec
from pstrain_api.model import TrainingJob
from pstrain_api.quote import describe
from pstrain_api.readiness import runs_pstrain_runtime
from pstrain_api.template import main_container

from .processes import DEFAULT_REPLICA_COMMAND
from .supervisor import Level

Notice = tuple[Level, str]


# --------------------------------------------------------------------------- entry point


def trains_with_runtime(job: TrainingJob) -> bool:
    """Some worker (or the chief) runs `pstrain replica`, which loads the entry point."""
    roles = [job.spec.replicas.worker, job.spec.replicas.chief]
    return any(spec is not None and runs_pstrain_runtime(spec) for spec in roles)


def entrypoint_problem(job: TrainingJob, replica_command: Sequence[str],
                       cwd: str | None = None) -> str | None:
    """Why the replicas cannot load spec.training.entrypoint, or None (also when this
    cannot be told from here: another replica command, which may be another Python, or
    no role that loads it)."""
    if tuple(replica_command) != DEFAULT_REPLICA_COMMAND or not trains_with_runtime(job):
        return None
    return locate_problem(job.spec.training.entrypoint, cwd or os.getcwd())


def locate_problem(entrypoint: str, cwd: str) -> str | None:
    """The runtime's sentence (`pstrain_api.entrypoint`) for an entry point whose module
    cannot be found or parsed, or whose source binds no such name; else None."""
    module_name, sep, func_name = entrypoint.partition(":")
    where = f"spec.training.entrypoint is {entrypoint!r}"
    if not sep or not module_name or not func_name:
        return f"{where}; it must be module:function"
    try:
        source = _module_source(module_name, cwd)
        tree = ast.parse(source) if source is not None else None
    except Exception as exc:  # a parent package's __init__ may raise anything
        return f"{where}; module {module_name!r} cannot be imported: {describe(exc)}"
    if tree is not None and not _may_bind(tree, func_name):
        return f"{where}; {module_name} has no function {func_name!r}"
    return None


def _module_source(module_name: str, cwd: str) -> str | None:
    """The module's source, None when it has none to read (an extension, a namespace
    package); ModuleNotFoundError when the replicas' import path lacks it."""
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        spec = importlib.util.find_spec(module_name)
    finally:
        if added:
            sys.path.remove(cwd)
    if spec is None:
        raise ModuleNotFoundError(f"No module named {module_name!r}")
    if spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin).read_text(encoding="utf-8")


def _may_bind(tree: ast.Module, name: str) -> bool:
    """The module's top level may bind `name` (True when it cannot be told: a star
    import, a module __getattr__, globals() at work)."""
    bound: set[str] = set()
    for node in _top_level(tree.body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(alias.name == "*" for alias in node.names):
                return True
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.Name) and node.id in ("globals", "vars", "exec"):
            return True
    return name in bound or "__getattr__" in bound


def _top_level(body: Iterable[ast.stmt]) -> Iterable[ast.AST]:
    """The nodes of the module's own scope: into if/try/with/loops, not into bodies
    of functions and classes (only their names are bound here)."""
    for stmt in body:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield stmt
            continue
        for node in ast.walk(stmt):
            yield node


# --------------------------------------------------------------------------- notices


def startup_notices(job: TrainingJob, spec: ClusterSpec, gpus: Mapping[str, str],
                    temp_dir: str | None, *, memory_warning: str | None = None,
                    cores_warning: str | None = None,
                    control_problem: str | None = None) -> list[Notice]:
    """The lines that open a run, in order; the last says how to scale the job while
    it runs, when it can be (`control_problem`: why `pstrain scale` cannot reach it)."""
    notices: list[Notice] = [("info", f"job {job.name}: " + ", ".join(
        f"{spec.replica_name(t)}@{spec.addresses[t]}" for t in spec.tasks()))]
    notices += [("warning", text) for text in (memory_warning, cores_warning) if text]
    if job.spec.run_policy.suspend:
        notices.append(("warning", "spec.runPolicy.suspend is true; pstrain run ignores it "
                                   "and runs the job now."))
    if job.spec.security.tls is not None:
        notices.append(("warning", "spec.security.tls names a Kubernetes Secret; pstrain "
                                   "run cannot read it and runs on loopback without TLS."))
    pod_only = pod_only_notice(job)
    if pod_only:
        notices.append(("warning", pod_only))
    if gpus:
        notices.append(("info", "GPUs: " + ", ".join(f"{n}={d}" for n, d in gpus.items()
                                                     if d)))
    if temp_dir:
        notices.append(("info", f"checkpoints go to the temporary directory {temp_dir} "
                                "(removed at exit unless the job stops early and can "
                                "resume from it; pass --checkpoint-dir to keep them)"))
    else:
        notices.append(("info", "checkpoints go to "
                                f"{job.spec.training.checkpoint.directory}"))
    if control_problem:
        notices.append(("warning", f"`pstrain scale` cannot reach this run: "
                                   f"{control_problem}"))
    elif may_scale(job):
        notices.append(("info", scale_hint(job)))
    return notices


def pod_only_notice(job: TrainingJob) -> str | None:
    """What the pod templates of roles that run a program of the user's own ask of a
    container and a local run cannot give: an image, volume mounts. Their commands run
    on this machine as written, so a program that lives in that image or volume is not
    found (examples/tf-ps.yaml)."""
    asks: dict[str, list[str]] = {}
    for role in c.ROLES:
        try:
            spec = job.replica_spec(role)
        except KeyError:
            continue
        if runs_pstrain_runtime(spec):
            continue
        main = main_container(spec.template)
        what = [f"image {main['image']}"] if main.get("image") else []
        mounts = [m.get("mountPath") for m in main.get("volumeMounts") or []]
        if mounts:
            what.append("volumes at " + ", ".join(str(m) for m in mounts))
        if what:
            asks.setdefault(" and ".join(what), []).append(role)
    if not asks:
        return None
    parts = [f"the {', '.join(roles)} template{'s' if len(roles) > 1 else ''} "
             f"{'set' if len(roles) > 1 else 'sets'} {what}" for what, roles in asks.items()]
    return ("; ".join(parts) + ", which a local run does not use (its replicas run "
            "this machine's Python and files): a program that lives there is not found "
            "locally; run the job on a cluster")


def may_scale(job: TrainingJob) -> bool:
    """`pstrain scale` can change this job's workers: the parameter servers and the
    workers run the pstrain runtime (a program of its own learns its workers from
    TF_CONFIG alone, once), and the bounds allow a count other than the one it has."""
    workers = job.spec.replicas.worker
    if not (runs_pstrain_runtime(job.spec.replicas.ps) and runs_pstrain_runtime(workers)):
        return False
    low = workers.min_replicas or 1
    return workers.max_replicas is None or low < workers.max_replicas


def scale_hint(job: TrainingJob) -> str:
    workers = job.spec.replicas.worker
    low = workers.min_replicas or 1
    bounds = (f"{low} or more" if workers.max_replicas is None
              else f"{low} to {workers.max_replicas}")
    return (f"change the worker count while it runs ({bounds} workers): "
            f"pstrain scale {job.name} --replicas N")
