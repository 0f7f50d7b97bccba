"""Turning manifests into validated TrainingJobs, and every problem into a sentence that
names the field path, the bad value and what is allowed.

Used by `pstrain validate`, `pstrain run` and the operator; nothing here raises a
traceback at the user for bad input: problems come back as `Problem`s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from . import constants as c
from . import rules
from .model import TrainingJob


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one manifest."""

    source: str
    path: str
    message: str

    def __str__(self) -> str:
        where = f"{self.source}: " if self.source else ""
        return f"{where}{self.message}"


class InvalidManifest(ValueError):
    """A manifest that cannot be used; `problems` lists why."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def _path(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _lookup(data: Any, loc: Iterable[int | str]) -> tuple[bool, Any]:
    cur = data
    for part in loc:
        try:
            cur = cur[part]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, cur


def _model_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The pydantic model that owns the field at `loc` (for listing known fields)."""
    model: Any = TrainingJob
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = next(
            (f for n, f in model.model_fields.items() if part in (n, f.alias)), None
        )
        if field is None:
            return None
        model = _first_model(field.annotation)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _first_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def _describe(err: Mapping[str, Any], data: Any) -> str:
    """One pydantic error as 'PATH is VALUE; RULE.'"""
    loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
    path = _path(loc)
    kind = err["type"]
    ctx = err.get("ctx") or {}
    found, value = _lookup(data, loc)
    shown = repr(value) if found else "missing"

    if kind == "missing":
        return f"{path} is required but missing."
    if kind == "extra_forbidden":
        model = _model_at(loc)
        known = sorted(f.alias or n for n, f in model.model_fields.items()) if model else []
        allowed = f"; known fields here are: {', '.join(known)}" if known else ""
        return f"{path} is not a known field{allowed}."
    if kind == "literal_error":
        return f"{path} is {shown}; it must be one of {ctx.get('expected')}."
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        words = {
            "greater_than_equal": ("at least", "ge"),
            "greater_than": ("greater than", "gt"),
            "less_than_equal": ("at most", "le"),
            "less_than": ("less than", "lt"),
        }[kind]
        bound = next(iter(ctx.values()), "")
        return f"{path} is {shown}; it must be {words[0]} {bound}."
    if kind == "string_pattern_mismatch":
        if path.endswith("entrypoint"):
            return (
                f"{path} is {shown}; it must be 'module:function', e.g. "
                "'mypackage.model:make_task' (dotted module path, a colon, a function name)."
            )
        return f"{path} is {shown}; it must match the pattern {ctx.get('pattern')}."
    if kind in ("string_too_short", "string_too_long", "too_short", "too_long"):
        return f"{path} is {shown}; {err['msg'][0].lower()}{err['msg'][1:]}."
    if kind == "value_error":
        reason = str(ctx.get("error", err["msg"]))
        prefix = f"{path}." if path else ""
        if path == "metadata" or reason.startswith("metadata."):
            return f"{reason}."
        return f"{prefix}{reason}."
    return f"{path} is {shown}; {err['msg'][0].lower()}{err['msg'][1:]}."


def check_manifest(data: Any, source: str = "") -> tuple[TrainingJob | None, list[Problem]]:
    """Validate one parsed manifest; return the job or the problems, never both."""
    if not isinstance(data, dict):
        kind = type(data).__name__ if data is not None else "empty"
        return None, [Problem(source, "", f"the document is {kind}; it must be a mapping "
                                          f"with apiVersion {c.API_VERSION} and kind {c.KIND}.")]
    problems: list[Problem] = []
    for key, want in (("apiVersion", c.API_VERSION), ("kind", c.KIND)):
        if data.get(key) != want:
            shown = repr(data[key]) if key in data else "missing"
            problems.append(Problem(source, key, f"{key} is {shown}; it must be {want!r}."))
    if problems:
        return None, problems
    try:
        job = TrainingJob.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            loc = err["loc"]
            problems.append(Problem(source, _path(loc), _describe(err, data)))
        # The model stops at a replica spec's first broken rule (and checks none where
        # a field has the wrong type); report every one.
        seen = {p.message for p in problems}
        for path, text in rules.manifest_problems(data):
            message = rules.sentence(path, text)
            if message not in seen:
                seen.add(message)
                problems.append(Problem(source, path, message))
        return None, problems
    return job, []


def parse_documents(text: str, source: str = "") -> tuple[list[Any], list[Problem]]:
    """YAML (one or more documents) to Python objects, or a problem naming the line."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc)
        return [], [Problem(source, "", f"the file is not valid YAML{where}: {reason}.")]
    if not docs:
        return [], [Problem(source, "", "the file holds no YAML document.")]
    return docs, []


def load_jobs(path: str | Path) -> tuple[list[TrainingJob], list[Problem]]:
    """Every TrainingJob in a YAML file, and every problem found."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        return [], [Problem(source, "", f"cannot read the file: {exc.strerror or exc}.")]
    docs, problems = parse_documents(text, source)
    jobs: list[TrainingJob] = []
    multi = len(docs) > 1
    for i, doc in enumerate(docs):
        job, found = check_manifest(doc, f"{source}#{i + 1}" if multi else source)
        problems.extend(found)
        if job is not None:
            jobs.append(job)
    return jobs, problems


def load_job(path: str | Path) -> TrainingJob:
    """Exactly one TrainingJob from a file, or InvalidManifest."""
    jobs, problems = load_jobs(path)
    if problems:
        raise InvalidManifest(problems)
    if len(jobs) != 1:
        raise InvalidManifest([Problem(str(path), "", f"the file holds {len(jobs)} "
                                                      "TrainingJobs; give exactly one.")])
    return jobs[0]
