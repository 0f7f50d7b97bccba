"""Names shared by every pstrain component: the API group, label keys, environment
variables, ports, phases, condition types and reasons.

Nothing here does I/O; everything that must agree between the operator, the local
runner and the runtime is spelled once, here.
"""

from __future__ import annotations

from typing import Final, Literal

GROUP: Final = "pstrain.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "TrainingJob"
PLURAL: Final = "trainingjobs"
SINGULAR: Final = "trainingjob"
SHORT_NAMES: Final = ("tj",)
CATEGORIES: Final = ("all", "pstrain")
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# Roles, in the order they are started.
Role = Literal["ps", "worker", "chief"]
ROLE_PS: Final = "ps"
ROLE_WORKER: Final = "worker"
ROLE_CHIEF: Final = "chief"
ROLES: Final = (ROLE_PS, ROLE_WORKER, ROLE_CHIEF)

# Labels put on every child object.
LABEL_JOB: Final = f"{GROUP}/job-name"
LABEL_ROLE: Final = f"{GROUP}/replica-role"
LABEL_INDEX: Final = f"{GROUP}/replica-index"
LABEL_IS_CHIEF: Final = f"{GROUP}/is-chief"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "pstrain-operator"

# Environment injected into every replica. Users may not set these themselves.
ENV_CLUSTER: Final = "PSTRAIN_CLUSTER"
ENV_TRAINING: Final = "PSTRAIN_TRAINING"
ENV_TF_CONFIG: Final = "TF_CONFIG"
RESERVED_ENV_PREFIX: Final = "PSTRAIN_"
RESERVED_ENV_NAMES: Final = frozenset({ENV_TF_CONFIG})

# Networking. 2222 is TensorFlow's conventional port for PS/worker servers.
REPLICA_PORT: Final = 2222
REPLICA_PORT_NAME: Final = "pstrain"
# A parameter server's data plane (tensors over plain TCP, pstrain_runtime.transport.dataplane).
DATA_PORT: Final = 2223
DATA_PORT_NAME: Final = "pstrain-data"
ENV_DATA_PORT: Final = "PSTRAIN_DATA_PORT"  # where a PS listens for it; unset: any port
LOCAL_HOST: Final = "127.0.0.1"
# Every replica pod serves Prometheus metrics here (pstrain_runtime.metrics); locally the
# variable is unset and no metrics server starts.
METRICS_PORT: Final = 9400
METRICS_PORT_NAME: Final = "metrics"
ENV_METRICS_PORT: Final = "PSTRAIN_METRICS_PORT"

# Readiness gates of a replica (pstrain_api.readiness): what "ready" means for its program.
ReadinessGate = Literal["Auto", "GRPCHealth", "TCP", "None"]
GATE_GRPC: Final = "GRPCHealth"
GATE_TCP: Final = "TCP"
GATE_PROBE: Final = "Probe"  # the user's own readinessProbe from the template
GATE_NONE: Final = "None"

# Main container name in generated pods (the env is injected into every container, not
# only this one).
MAIN_CONTAINER: Final = "pstrain"
DEFAULT_RUNTIME_IMAGE: Final = "ghcr.io/pstrain/pstrain-runtime:0.1.0"
GPU_RESOURCE: Final = "nvidia.com/gpu"

# Kubernetes name limits.
DNS_LABEL_MAX: Final = 63
DNS_SUBDOMAIN_MAX: Final = 253

Phase = Literal["Pending", "Starting", "Running", "Succeeded", "Failed", "Suspended"]
PHASES: Final = ("Pending", "Starting", "Running", "Succeeded", "Failed", "Suspended")
TERMINAL_PHASES: Final = frozenset({"Succeeded", "Failed"})

# Condition types (Kubernetes convention: CamelCase, status True/False/Unknown).
COND_CREATED: Final = "Created"
COND_RUNNING: Final = "Running"
COND_SUCCEEDED: Final = "Succeeded"
COND_FAILED: Final = "Failed"
COND_SUSPENDED: Final = "Suspended"
COND_SPEC_REJECTED: Final = "SpecChangeRejected"
COND_CREATE_REJECTED: Final = "CreateRejected"

# Exit codes that the ExitCode restart policy treats as retryable: killed by a signal
# that says "the node or the scheduler stopped me" rather than "my program is wrong".
# 130 SIGINT, 137 SIGKILL (also the OOM killer), 143 SIGTERM (eviction, preemption).
RETRYABLE_EXIT_CODES: Final = frozenset({130, 137, 143})
# A replica that exits with this code found a mistake in the job's configuration (an
# entry point that cannot be imported or called, an unusable checkpoint directory) that
# no restart can fix: the job fails at once, whatever the restart policy. 78 is
# sysexits.h's EX_CONFIG.
EXIT_CONFIGURATION_ERROR: Final = 78

# Where a replica writes its last error line when it fails (Kubernetes shows the file's
# content as the container's termination message). Unset: /dev/termination-log when it
# exists (in a pod), else nowhere; empty: nowhere.
ENV_TERMINATION_LOG: Final = "PSTRAIN_TERMINATION_LOG"
TERMINATION_LOG_PATH: Final = "/dev/termination-log"
TERMINATION_MESSAGE_MAX_BYTES: Final = 4096  # the kubelet keeps no more
# A trainer exits with this code when the parameter servers did not answer their health
# check within the gang start's startup timeout: the job fails (reason StartupTimeout).
EXIT_STARTUP_TIMEOUT: Final = 75
# Gang start: how long (seconds) a trainer waits for every parameter server at startup.
ENV_STARTUP_TIMEOUT: Final = "PSTRAIN_STARTUP_TIMEOUT"
