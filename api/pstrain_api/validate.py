"""Turning manifests into validated TrainingJobs, and every problem into a sentence that
names the field path, the bad value and what is allowed.

Used by `pstrain validate`, `pstrain run` and the operator; nothing here raises a
traceback at the user for bad input: problems come back as `Problem`s.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from . import constants as c
from . import rules
from .cluster import environment_problem
from .kube_rules import kubernetes_problems
from .manifest_yaml import ManifestLimitError, UnreadableManifest, load_all, read_manifest_text
from .model import TrainingJob
from .quote import MAX_QUOTED, quote
from .spelling import spelling_hint

# Kubernetes' ObjectMeta (meta/v1), every field the API server accepts under metadata.
METADATA_FIELDS = ("annotations", "creationTimestamp", "deletionGracePeriodSeconds",
                   "deletionTimestamp", "finalizers", "generateName", "generation", "labels",
                   "managedFields", "name", "namespace", "ownerReferences", "resourceVersion",
                   "selfLink", "uid")


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
            part = str(part)
            if len(part) > MAX_QUOTED:  # a user's key: shortened like any value
                part = quote(part)
            out += f".{part}" if out else part
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


# Type errors of strict fields (as the API server has them: no '200' for 200, no true for
# 1), and what the field wants.
_TYPE_WANTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
    "int_or_string_type": "an integer or a string",
}
# Errors raised by the model's own types (model.py), whose ctx['rule'] is the rule.
_CUSTOM_RULES = {"kubernetes_name"}


def _kind_of(value: Any) -> str:
    """How a YAML user would call the type of `value`."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def _strip_union_tags(errors: Sequence[Mapping[str, Any]], data: Any) -> list[dict[str, Any]]:
    """pydantic reports a value that fits no branch of `int | str` once per branch, with
    the branch's name appended to the location. Make that one error at the field."""
    out: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    for err in errors:
        loc = tuple(err["loc"])
        if not (len(loc) > 1 and loc[-1] in ("int", "str") and not _lookup(data, loc)[0]
                and _lookup(data, loc[:-1])[0]):
            out.append(dict(err))
        elif loc[:-1] not in seen:
            seen.add(loc[:-1])
            kind = "int_or_string_type" if err["type"] in _TYPE_WANTED else err["type"]
            out.append({**err, "loc": loc[:-1], "type": kind})
    return out


def _describe(err: Mapping[str, Any], data: Any) -> str:
    """One pydantic error as 'PATH is VALUE; RULE.'"""
    loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
    path = _path(loc)
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if loc and loc[-1] == "[key]":  # a mapping key that breaks the rule for keys
        return f"{_path(loc[:-2])} has the key {quote(loc[-2])}; {ctx.get('rule', err['msg'])}."
    found, value = _lookup(data, loc)
    shown = quote(value) if found else "missing"

    if kind == "missing":
        return f"{path} is required but missing."
    if kind == "extra_forbidden":
        model = _model_at(loc)
        known = sorted(f.alias or n for n, f in model.model_fields.items()) if model else []
        return unknown_field(path, str(loc[-1]), known)
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
    if kind in _TYPE_WANTED:
        return f"{path} is {shown}; it must be {_TYPE_WANTED[kind]}, not {_kind_of(value)}."
    if kind == "finite_number":
        return f"{path} is {shown}; it must be a finite number."
    if kind in _CUSTOM_RULES:
        return f"{path} is {shown}; {ctx.get('rule', err['msg'])}."
    if kind == "value_error":
        reason = str(ctx.get("error", err["msg"]))
        prefix = f"{path}." if path else ""
        if path == "metadata" or (not path and reason.startswith("metadata.")):
            return f"{reason}."
        return f"{prefix}{reason}."
    return f"{path} is {shown}; {err['msg'][0].lower()}{err['msg'][1:]}."


def unknown_field(path: str, key: str, known: Sequence[str]) -> str:
    """'PATH is not a known field', with the right spelling or the closest field, and the
    fields known there (the API server refuses unknown fields, snake_case ones too)."""
    hint = spelling_hint(key, known)
    if hint.startswith("; it is spelled"):
        return f"{path} is not a known field{hint}."
    listed = f" Known fields here are: {', '.join(known)}." if known else ""
    return f"{path} is not a known field{hint}.{listed}"


def _metadata_problems(data: Mapping[str, Any], source: str) -> list[Problem]:
    """Fields under metadata that Kubernetes' ObjectMeta does not have (pstrain reads a
    few of them; the API server refuses any other)."""
    meta = data.get("metadata")
    if not isinstance(meta, Mapping):
        return []
    return [Problem(source, f"metadata.{key}",
                    unknown_field(f"metadata.{_path([str(key)])}", str(key), METADATA_FIELDS))
            for key in meta if key not in METADATA_FIELDS]


# ObjectMeta's bound on all annotations together (keys and values), in bytes.
ANNOTATIONS_MAX_BYTES = 256 * 1024


def _annotations_problems(data: Mapping[str, Any], source: str) -> list[Problem]:
    meta = data.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    if not isinstance(annotations, Mapping):
        return []
    size = sum(len(str(k).encode()) + len(str(v).encode()) for k, v in annotations.items()
               if isinstance(v, str))
    if size <= ANNOTATIONS_MAX_BYTES:
        return []
    return [Problem(source, "metadata.annotations",
                    f"metadata.annotations are {size} bytes in all; they must be at most "
                    f"{ANNOTATIONS_MAX_BYTES} (256 KiB).")]


def as_the_server_reads(data: dict[str, Any]) -> dict[str, Any]:
    """A manifest as the API server takes it on create: without `status` (a
    subresource: ignored), and without null fields (no field of the CRD is nullable,
    so the server drops them, then defaults them)."""
    def drop_nulls(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: drop_nulls(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [drop_nulls(v) for v in value]
        return value

    return drop_nulls({k: v for k, v in data.items() if k != "status"})


def _integral_floats(data: Any, errors: Sequence[Mapping[str, Any]]) -> Any | None:
    """`data` with each integer field written as a whole float (100.0) made an integer,
    as the API server reads it; None when no error is one of those."""
    fixes = []
    for err in errors:
        found, value = _lookup(data, err["loc"])
        if (err["type"] == "int_type" and found and isinstance(value, float)
                and value.is_integer() and INT64_MIN <= value <= INT64_MAX):
            fixes.append(tuple(err["loc"]))
    if not fixes:
        return None
    out = copy.deepcopy(data)
    for loc in fixes:
        parent = _lookup(out, loc[:-1])[1]
        parent[loc[-1]] = int(parent[loc[-1]])
    return out


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64_problems(data: Any, source: str) -> list[Problem]:
    """Integers anywhere in the document (free-form fields included) that do not fit in
    the int64 every Kubernetes integer is."""
    problems = []
    stack: list[tuple[tuple[int | str, ...], Any]] = [((), data)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, dict):
            stack.extend(((*loc, str(k)), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*loc, i), v) for i, v in reversed(list(enumerate(value))))
        elif (isinstance(value, int) and not isinstance(value, bool)
              and not INT64_MIN <= value <= INT64_MAX):
            path = _path(loc)
            problems.append(Problem(source, path, f"{path} is {quote(value)}; it must fit "
                                                  f"in a 64-bit integer (at most {INT64_MAX})."))
    return problems


# Problems reported per document; a list of a million bad items gets this many lines and a
# count, not a million lines.
MAX_PROBLEMS = 20


def _at_most(problems: list[Problem], source: str, total: int | None = None) -> list[Problem]:
    """The first MAX_PROBLEMS of `total` problems, and a count of the rest."""
    more = (len(problems) if total is None else total) - MAX_PROBLEMS
    if more <= 0:
        return problems
    return [*problems[:MAX_PROBLEMS],
            Problem(source, "", f"... and {more} more problems like these.")]


def _model(data: dict[str, Any]) -> TrainingJob:
    """The TrainingJob of a manifest, from the wire spelling only (camelCase, as on the
    API server: by_name would also take batch_size for batchSize), integers written as
    whole floats taken as the API server takes them."""
    try:
        return TrainingJob.model_validate(data, by_name=False)
    except ValidationError as exc:
        fixed = _integral_floats(data, exc.errors())
        if fixed is None:
            raise
    return TrainingJob.model_validate(fixed, by_name=False)


def check_manifest(data: Any, source: str = "") -> tuple[TrainingJob | None, list[Problem]]:
    """Validate one parsed manifest; return the job or the problems, never both."""
    if not isinstance(data, dict):
        kind = type(data).__name__ if data is not None else "empty"
        return None, [Problem(source, "", f"the document is {kind}; it must be a mapping "
                                          f"with apiVersion {c.API_VERSION} and kind {c.KIND}.")]
    problems: list[Problem] = []
    for key, want in (("apiVersion", c.API_VERSION), ("kind", c.KIND)):
        if data.get(key) != want:
            shown = quote(data[key]) if key in data else "missing"
            problems.append(Problem(source, key, f"{key} is {shown}; it must be {want!r}."))
    problems.extend(_int64_problems(data, source))
    if problems:
        return None, _at_most(problems, source)
    data = as_the_server_reads(data)
    unknown_meta = _metadata_problems(data, source) + _annotations_problems(data, source)
    try:
        job = _model(data)
    except ValidationError as exc:
        errors = _strip_union_tags(exc.errors(), data)
        for err in errors[:MAX_PROBLEMS]:
            problems.append(Problem(source, _path(err["loc"]), _describe(err, data)))
        # The model stops at a replica spec's first broken rule (and checks none where
        # a field has the wrong type); report every one.
        seen = {p.message for p in problems}
        extra = 0
        for path, text in rules.manifest_problems(data):
            message = rules.sentence(path, text)
            if message not in seen:
                seen.add(message)
                problems.append(Problem(source, path, message))
                extra += 1
        problems += unknown_meta
        return None, _at_most(problems, source, total=len(errors) + extra + len(unknown_meta))
    if unknown_meta:
        return None, unknown_meta
    too_large = environment_problem(job)
    if too_large:
        path, message = too_large
        return None, [Problem(source, path, f"{message}.")]
    return job, []


def check_for_kubernetes(data: Any, source: str = "") -> tuple[TrainingJob | None,
                                                                 list[Problem]]:
    """`check_manifest`, then the rules that hold on Kubernetes only (`kube_rules`: what
    `pstrain run` fills in itself, e.g. sparseStorage.directory): the operator's check."""
    job, problems = check_manifest(data, source)
    if job is None:
        return None, problems
    found = [Problem(source, path, f"{message}.")
             for path, message in kubernetes_problems(job)]
    return (None, found) if found else (job, [])


def parse_documents(text: str, source: str = "") -> tuple[list[Any], list[Problem]]:
    """YAML (one or more documents) to Python objects, or a problem naming the line."""
    try:
        docs = [d for d in load_all(text) if d is not None]
    except ManifestLimitError as exc:
        mark = exc.problem_mark
        return [], [Problem(source, "", f"line {mark.line + 1}, column {mark.column + 1}: "
                                        f"{exc.problem}.")]
    except yaml.reader.ReaderError as exc:
        return [], [Problem(source, "", f"the file is not valid YAML: character "
                                        f"{quote(chr(exc.character))} at offset "
                                        f"{exc.position} may not appear in YAML text.")]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        return [], [Problem(source, "", f"the file is not valid YAML{where}: {reason}.")]
    if not docs:
        return [], [Problem(source, "", "the file holds no YAML document.")]
    return docs, []


def load_jobs(path: str | Path) -> tuple[list[TrainingJob], list[Problem]]:
    """Every TrainingJob in a YAML file, and every problem found."""
    source = str(path)
    try:
        text = read_manifest_text(path)
    except UnreadableManifest as exc:
        return [], [Problem(source, "", f"{exc}.")]
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
