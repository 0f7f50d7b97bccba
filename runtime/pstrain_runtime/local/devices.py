"""Which GPUs each local replica may see (CUDA_VISIBLE_DEVICES).

On Kubernetes the device plugin gives every pod its own GPUs. On one machine every
process sees every GPU and the runtime would put every trainer on `cuda:0`, so the
runner spreads trainers over the GPUs round-robin, and hides GPUs from parameter
servers (they keep parameters and optimizer state on the CPU, by API rule).

`assign_gpus` is pure; `visible_gpus` asks the machine (environment, then nvidia-smi).
Without GPUs nothing is set and replicas run on the CPU.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pstrain_api import constants as c

ENV_VISIBLE = "CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class DeviceRequest:
    name: str
    role: str
    gpus: int  # GPUs the role's spec asks for per replica (0: none asked)


def assign_gpus(requests: Sequence[DeviceRequest], visible: Sequence[str]) -> dict[str, str]:
    """CUDA_VISIBLE_DEVICES for each replica, or {} when the machine has no GPU.

    Trainers, in order, take max(gpus, 1) devices each from `visible`, round-robin and
    never the same device twice for one replica; devices are shared once there are more
    trainers than GPUs. Parameter servers see none.
    """
    if not visible:
        return {}
    out: dict[str, str] = {}
    cursor = 0
    for req in requests:
        if req.role == c.ROLE_PS:
            out[req.name] = ""
            continue
        count = min(max(req.gpus, 1), len(visible))
        picked = [visible[(cursor + i) % len(visible)] for i in range(count)]
        cursor = (cursor + count) % len(visible)
        out[req.name] = ",".join(picked)
    return out


def parse_visible(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES as a list; "", "-1" or "none" hide every GPU."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items or items[0] in ("-1", "none", "NoDevFiles"):
        return []
    return items


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES when set, else the
    indices nvidia-smi lists, else none."""
    env = os.environ if environ is None else environ
    if ENV_VISIBLE in env:
        return parse_visible(env[ENV_VISIBLE])
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if listing.returncode != 0:
        return []
    return [line.strip() for line in listing.stdout.splitlines() if line.strip().isdigit()]
