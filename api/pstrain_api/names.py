"""Deterministic names of a job's children and the rules a job name must meet.

Invariants: every child name is a valid DNS-1123 label of at most 63 characters (pods
double as hostnames), the same job always gets the same names, and two different jobs
never share a child name even when their names are truncated.
"""

from __future__ import annotations

import hashlib
import re

from . import constants as c
from .quote import named

DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1035_RULE = ("it must be a DNS-1035 label: lowercase letters, digits and '-', starting "
                 "with a letter and ending with a letter or digit")
NAME_TOO_LONG = (f"the job's Service is named after it and must be at most {c.DNS_LABEL_MAX} "
                 "characters")
DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_SUBDOMAIN_MAX = 253
# A label key in one pattern (RE2 and Python alike, for the CRD's CEL rule): an optional
# DNS-1123 subdomain and '/', then a name of 1 to 63 characters. The prefix's bound
# (DNS_SUBDOMAIN_MAX) is checked apart.
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_KEY_RULE = ("it must be a label key: an optional DNS subdomain and '/', then at most "
                  f"{c.DNS_LABEL_MAX} letters, digits, '-', '_' and '.', starting and ending "
                  "with a letter or digit")
HASH_LEN = 5


# Why a string is not a Kubernetes name of each kind, or None when it is one; the text
# completes "... is VALUE; it must be ...". The rules are Kubernetes' own
# (apimachinery/pkg/util/validation).


def dns_label_problem(value: str) -> str | None:
    """Namespaces, volume names: RFC 1123 labels."""
    if len(value) <= c.DNS_LABEL_MAX and DNS_1123_LABEL.fullmatch(value):
        return None
    return (f"it must be a DNS-1123 label: at most {c.DNS_LABEL_MAX} lowercase letters, "
            "digits and '-', starting and ending with a letter or digit")


def dns_subdomain_problem(value: str) -> str | None:
    """Service accounts, priority classes, secrets: RFC 1123 subdomains."""
    if len(value) <= DNS_SUBDOMAIN_MAX and DNS_1123_SUBDOMAIN.fullmatch(value):
        return None
    return (f"it must be a DNS-1123 subdomain: at most {DNS_SUBDOMAIN_MAX} lowercase "
            "letters, digits, '-' and '.', starting and ending with a letter or digit")


def label_value_problem(value: str) -> str | None:
    if len(value) <= c.DNS_LABEL_MAX and LABEL_VALUE.fullmatch(value):
        return None
    return (f"it must be a label value: empty, or at most {c.DNS_LABEL_MAX} letters, "
            "digits, '-', '_' and '.', starting and ending with a letter or digit")


def label_key_problem(value: str) -> str | None:
    """Label and annotation keys: an optional DNS-subdomain prefix and '/', then a name
    of at most 63 letters, digits, '-', '_' and '.'."""
    prefix, slash, name = value.rpartition("/")
    if (name and label_value_problem(name) is None
            and (not slash or dns_subdomain_problem(prefix) is None)):
        return None
    return LABEL_KEY_RULE


def check_job_name(name: str) -> str | None:
    """Why `name` cannot name a TrainingJob, or None when it can.

    The job's headless Service is named after the job, and Service names must be
    DNS-1035 labels: lowercase letters, digits and '-', starting with a letter, ending
    with a letter or digit, at most 63 characters.
    """
    if len(name) > c.DNS_LABEL_MAX:
        return f"metadata.name has {len(name)} characters; {NAME_TOO_LONG}"
    if not DNS_1035_LABEL.fullmatch(name):
        return f"metadata.name is {named(name)}; {DNS_1035_RULE}"
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
