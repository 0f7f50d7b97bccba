"""Deterministic names of a job's children and the rules a job name must meet.

Invariants: every child name is a valid DNS-1123 label of at most 63 characters (pods
double as hostnames), the same job always gets the same names, and two different jobs
never share a child name even when their names are truncated.
"""

from __future__ import annotations

import hashlib
import re

from . import constants as c

DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1035_RULE = ("it must be a DNS-1035 label: lowercase letters, digits and '-', starting "
                 "with a letter and ending with a letter or digit")
HASH_LEN = 5


def check_job_name(name: str) -> str | None:
    """Why `name` cannot name a TrainingJob, or None when it can.

    The job's headless Service is named after the job, and Service names must be
    DNS-1035 labels: lowercase letters, digits and '-', starting with a letter, ending
    with a letter or digit, at most 63 characters.
    """
    if len(name) > c.DNS_LABEL_MAX:
        return (
            f"metadata.name is {name!r} ({len(name)} characters); the job's Service is "
            f"named after it and must be at most {c.DNS_LABEL_MAX} characters"
        )
    if not DNS_1035_LABEL.match(name):
        return (
            f"metadata.name is {name!r}; {DNS_1035_RULE}"
        )
    return None


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_LEN]


def bounded_name(base: str, suffix: str, limit: int = c.DNS_LABEL_MAX) -> str:
    """`base` + `suffix`, shortened to `limit` characters by truncating `base` and adding
    a hash of the whole base, so that different bases never collide."""
    name = f"{base}{suffix}"
    if len(name) <= limit:
        return name
    keep = limit - len(suffix) - HASH_LEN - 1
    if keep < 1:
        raise ValueError(f"suffix {suffix!r} leaves no room for a name within {limit}")
    return f"{base[:keep].rstrip('-')}-{_short_hash(base)}{suffix}"


def service_name(job_name: str) -> str:
    """The job's headless Service: one per job, giving every pod a stable DNS name."""
    return job_name


def replica_name(job_name: str, role: str, index: int) -> str:
    """Pod name and hostname of one replica: `<job>-<role>-<index>`, at most 63 chars."""
    return bounded_name(job_name, f"-{role}-{index}")


def replica_host(job_name: str, namespace: str, role: str, index: int) -> str:
    """The replica's in-cluster DNS name through the headless Service."""
    return f"{replica_name(job_name, role, index)}.{service_name(job_name)}.{namespace}.svc"
