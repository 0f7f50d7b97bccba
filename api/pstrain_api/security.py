"""A job's credentials, as the operator, the local runner and the runtime agree on them.

Each job has one random token of 256 bits. Nothing uses the token itself on the wire:
each role gets a key derived from it with HMAC-SHA256, so a holder of the worker key
cannot compute the chief key.

- The chief key authorizes every call, including Init (and so restore), Finish,
  ReportStatus and Shutdown.
- The worker key is the job's shared one: it reads status (Info, GetJobStatus) and asks
  for a checkpoint (RequestCheckpoint), but acts for no worker. Worker i trains with its
  own key, derived from the worker key (`own_worker_key`), which lets it push and pull
  as worker i only; the chief may act for any worker.
- A parameter server holds both keys, to check either (and derives the workers' own).

Keys reach a replica as files in one directory (`ENV_AUTH_DIR`), one file per key,
named after it and holding the key in hex. Each replica gets only its own keys: a
parameter server `chief` and `worker`, the chief `chief`, worker i only `worker-<i>`.
In Kubernetes the directory is a Secret mounted read-only: the job's Secret (the role
keys) for the parameter servers and the chief, and worker i's own Secret
(`worker_secret_name`, holding `worker-<i>` only) for worker i, so that no worker pod
holds a key that could act for another. Locally each replica gets a private directory.
Keys never travel in environment variables.

Pure: no I/O; `pstrain_runtime.transport.auth` reads the files and speaks the protocols.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Mapping
from typing import Final, Literal

from . import constants as c

TOKEN_BYTES: Final = 32  # 256 bits
ENV_AUTH_DIR: Final = "PSTRAIN_AUTH_DIR"
AUTH_MOUNT_PATH: Final = "/var/run/pstrain/auth"
AUTH_VOLUME: Final = "pstrain-auth"
# TLS (opt-in): a kubernetes.io/tls Secret the user names, mounted with these files.
ENV_TLS_DIR: Final = "PSTRAIN_TLS_DIR"
TLS_MOUNT_PATH: Final = "/var/run/pstrain/tls"
TLS_VOLUME: Final = "pstrain-tls"
TLS_FILES: Final = ("tls.crt", "tls.key", "ca.crt")

KeyRole = Literal["chief", "worker"]
KEY_CHIEF: Final = "chief"
KEY_WORKER: Final = "worker"
KEY_ROLES: Final = (KEY_CHIEF, KEY_WORKER)

# Worker i's own key goes by this name (file, proof): "worker-<i>", i in 0..2**31-1.
WORKER_OWN_PREFIX: Final = "worker-"
MAX_WORKER_INDEX: Final = 2**31 - 1  # the wire's worker fields are int32
_WORKER_OWN = re.compile(r"worker-(0|[1-9][0-9]{0,9})", re.ASCII)

KeyHolder = Literal["ps", "chief", "worker"]
# Which role keys of the job's Secret each kind of replica holds (file names in
# ENV_AUTH_DIR): a parameter server both, the chief (the chief role, or worker 0 when
# there is none) the chief key. Any other worker holds none of them, only its own key
# (`own_worker_name`), from its own Secret.
KEYS_FOR_HOLDER: Final[Mapping[str, tuple[str, ...]]] = {
    c.ROLE_PS: (KEY_CHIEF, KEY_WORKER),
    KEY_CHIEF: (KEY_CHIEF,),
}


def key_holder(role: str, is_chief: bool) -> KeyHolder:
    """Which keys a replica of `role` gets; `is_chief` as `ClusterSpec.is_chief` says."""
    if role == c.ROLE_PS:
        return "ps"
    return "chief" if is_chief else "worker"

_LABEL = b"pstrain/v1 role key "
_OWN_LABEL = b"pstrain/v1 own worker key "


def new_token() -> bytes:
    """A fresh job token: 256 random bits from the OS's CSPRNG."""
    return secrets.token_bytes(TOKEN_BYTES)


def derive_keys(token: bytes) -> dict[str, bytes]:
    """The role keys of a job token: HMAC-SHA256(token, label + role)."""
    if len(token) < TOKEN_BYTES:
        raise ValueError(f"a job token has {len(token)} bytes; it must have at least "
                         f"{TOKEN_BYTES}")
    return {role: hmac.new(token, _LABEL + role.encode(), hashlib.sha256).digest()
            for role in KEY_ROLES}


def own_worker_name(index: int) -> str:
    """The name of worker `index`'s own key (its key file and its proofs' identity)."""
    if not 0 <= index <= MAX_WORKER_INDEX:
        raise ValueError(f"a worker index is {index}; it must be in 0..{MAX_WORKER_INDEX}")
    return f"{WORKER_OWN_PREFIX}{index}"


def own_worker_index(name: str) -> int | None:
    """The index in an own worker key's name ("worker-3" -> 3); None for any other
    name (no sign, no leading zero, at most 2**31-1)."""
    match = _WORKER_OWN.fullmatch(name)
    if match is None:
        return None
    index = int(match.group(1))
    return index if index <= MAX_WORKER_INDEX else None


def own_worker_key(worker_key: bytes, index: int) -> bytes:
    """Worker `index`'s own key: HMAC-SHA256(the job's worker key, label + name). Whoever
    holds one worker's own key cannot compute another's, nor the worker key."""
    return hmac.new(worker_key, _OWN_LABEL + own_worker_name(index).encode(),
                    hashlib.sha256).digest()


def encode_key(key: bytes) -> str:
    """A key as it is stored in a file or a Secret: lowercase hex, one line."""
    return key.hex() + "\n"


def decode_key(text: str, where: str) -> bytes:
    """The key in `text` (as `encode_key` wrote it); `where` names the source in errors,
    which never quote the content."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{where} does not hold a hex key") from None
    if len(key) < TOKEN_BYTES:
        raise ValueError(f"{where} holds a key of {len(key)} bytes; it must have at "
                         f"least {TOKEN_BYTES}")
    return key


def secret_name(job_name: str) -> str:
    """The deterministic name of a job's credentials Secret (a DNS subdomain)."""
    return f"{job_name}-pstrain-auth"[: c.DNS_SUBDOMAIN_MAX]


def worker_secret_name(job_name: str, trainer: int) -> str:
    """The deterministic name of worker `trainer`'s own credentials Secret (a DNS
    subdomain; `trainer` is its index among the trainers, the chief's being 0)."""
    suffix = f"-pstrain-auth-{own_worker_name(trainer)}"
    return f"{job_name[: c.DNS_SUBDOMAIN_MAX - len(suffix)]}{suffix}"
