"""Asking the API server to validate a job, and reading its refusals: as a Status
(through the Python client: no kubectl process per case, so a table of a hundred bad
jobs costs a second) or as kubectl prints them.

An invalid object comes back, in kubectl's words, as

    The TrainingJob "j" is invalid: PATH: Invalid value: VALUE: MESSAGE

or, with several errors, one `* PATH: ...` line each. A CEL rule
(x-kubernetes-validations) of the CRD reports at the object that carries it, with the
value "object" (every pstrain rule sits on an object), and its message; a root rule's
path is `<nil>`. A schema rule (pattern, minimum, maxItems, type, ...) reports at the
field itself with the field's value, and strict field validation refuses the request
before that: `strict decoding error: unknown field "spec.training.batch_size"`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config

from pstrain_api import constants as c
from pstrain_api import rules

_INVALID = re.compile(r'is invalid: ?(.*)$', re.S)
_CEL = re.compile(r'^(?P<path>\S+): Invalid value: "object": (?P<message>.*)$')


@dataclass(frozen=True)
class ServerError:
    path: str  # "" at the root
    text: str  # everything after "PATH: "

    @property
    def cel_message(self) -> str | None:
        """The rule's message when this is a CEL rule's refusal, else None."""
        found = _CEL.match(f"{self.path or '<nil>'}: {self.text}")
        return found["message"] if found else None

    @property
    def sentence(self) -> str:
        """A CEL refusal as the sentence `pstrain validate` prints for it."""
        message = self.cel_message
        assert message is not None, f"not a CEL refusal: {self}"
        return rules.sentence(self.path, message)


def invalid_entries(output: str) -> list[ServerError]:
    """Every field error of an `is invalid` refusal in kubectl's output."""
    found = _INVALID.search(output)
    if not found:
        return []
    body = found[1].strip()
    lines = ([line[2:] for line in body.splitlines() if line.startswith("* ")]
             if body.startswith("* ") else [body.splitlines()[0]])
    out = []
    for line in lines:
        path, _, text = line.partition(": ")
        out.append(ServerError("" if path == "<nil>" else path.removeprefix("."), text))
    return out


def unknown_fields(output: str) -> list[str]:
    """The fields named by a strict-decoding refusal (`unknown field "spec.x"`)."""
    if "strict decoding error" not in output:
        return []
    return re.findall(r'unknown field "([^"]+)"', output)


def status_entries(status: dict[str, Any]) -> list[ServerError]:
    """Every field error of a refusal's Status (its details.causes)."""
    causes = (status.get("details") or {}).get("causes") or []
    # A few errors (the scale subresource's accessor) name the field with a leading dot.
    return [ServerError("" if cause.get("field") in (None, "<nil>")
                        else cause["field"].removeprefix("."), cause.get("message", ""))
            for cause in causes]


@dataclass(frozen=True)
class Answer:
    accepted: bool
    body: dict[str, Any]  # the object as the server would store it, or its Status

    @property
    def errors(self) -> list[ServerError]:
        return [] if self.accepted else status_entries(self.body)

    @property
    def message(self) -> str:
        return "" if self.accepted else self.body.get("message", "")


class JobServer:
    """Creates TrainingJobs on the API server, by default as a server-side dry run
    (validated, defaulted and admitted, never stored) with strict field validation:
    what `kubectl create --dry-run=server` sends."""

    def __init__(self, kubeconfig: Path):
        self.api = client.CustomObjectsApi(
            config.new_client_from_config(config_file=str(kubeconfig)))

    def create(self, namespace: str, body: dict[str, Any], dry_run: bool = True,
               field_validation: str = "Strict") -> Answer:
        kwargs = {"dry_run": "All"} if dry_run else {}
        try:
            made = self.api.create_namespaced_custom_object(
                c.GROUP, c.VERSION, namespace, c.PLURAL, body,
                field_validation=field_validation, _request_timeout=30, **kwargs)
        except client.ApiException as exc:
            if exc.status not in (400, 422):
                raise
            return Answer(False, json.loads(exc.body))
        return Answer(True, made)
