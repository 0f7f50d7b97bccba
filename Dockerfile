# syntax=docker/dockerfile:1
#
# pstrain's two images, from one file:
#
#   runtime   torch + pstrain; ENTRYPOINT `pstrain replica` (the PS and worker pods)
#   operator  pstrain without torch; ENTRYPOINT `pstrain operator` (the kopf operator)
#
#   docker build --target runtime  -t ghcr.io/pstrain/pstrain-runtime:0.1.0 .
#   docker build --target runtime  --build-arg TORCH_VARIANT=cu128 \
#                -t ghcr.io/pstrain/pstrain-runtime:0.1.0-cu128 .
#   docker build --target operator -t ghcr.io/pstrain/pstrain-operator:0.1.0 .
#
# TORCH_VARIANT names a PyTorch wheel index (https://download.pytorch.org/whl/<variant>):
# `cpu` (default, small), or a CUDA build such as `cu126`/`cu128` as listed for
# TORCH_VERSION in PyTorch's install matrix. CUDA wheels carry their CUDA libraries, so the
# same slim base serves both; GPU nodes need only the NVIDIA driver and device plugin.
#
# Every stage starts from the same pinned Python base (pin a digest as well with
# --build-arg PYTHON_IMAGE=python:3.11.13-slim-bookworm@sha256:<digest>). Dependencies are
# installed from wheels into a virtualenv in a build stage; the final stages only copy that
# virtualenv, so they hold no compiler, no pip cache and no build tools, and run as the
# unprivileged numeric user 65532 (numeric, so that Kubernetes' runAsNonRoot can verify it).

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

# ---------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN groupadd --system --gid 65532 pstrain \
 && useradd --system --uid 65532 --gid 65532 --home-dir /home/pstrain --create-home \
            --shell /usr/sbin/nologin pstrain

# ---------------------------------------------------------------------------------------
# The operator's virtualenv: pstrain without its dependencies, then exactly the
# dependencies the operator imports (each spelled as in pyproject.toml; a test checks
# that). grpcio and protobuf serve the runtime's torch-free status client, through which
# the operator reads training progress. torch, numpy and scikit-learn are never installed.
FROM base AS build-operator
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api ./api
COPY runtime ./runtime
COPY operator ./operator
RUN python -m venv /opt/venv \
 && pip install --no-deps /src \
 && pip install \
        "pydantic>=2.7,<3" \
        "PyYAML>=6,<7" \
        "kopf>=1.37,<2" \
        "kubernetes>=29,<38" \
        "prometheus-client>=0.20,<1" \
        "jsonschema>=4.20,<5" \
        "grpcio>=1.85.1,<2" \
        "protobuf>=7.35.1,<8" \
 && if pip show torch >/dev/null 2>&1; then echo "torch must not be in the operator image" >&2; exit 1; fi \
 && pstrain operator --help >/dev/null

# ---------------------------------------------------------------------------------------
# The runtime's virtualenv: torch from PyTorch's index for the chosen variant first (so
# that pstrain's `torch>=2.2,<3` is already satisfied), then pstrain and the rest, with
# the `data` extra (pyarrow, for pstrain_runtime.datasets) and the `disk` extra (rocksdict,
# for sparse rows beyond a parameter server's memory budget: spec.training.sparseStorage).
FROM base AS build-runtime
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
RUN python -m venv /opt/venv \
 && pip install "torch==${TORCH_VERSION}" \
        --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api ./api
COPY runtime ./runtime
COPY operator ./operator
RUN pip install "/src[data,disk]" \
 && pip check \
 && pstrain replica --help >/dev/null

# ---------------------------------------------------------------------------------------
FROM base AS operator
COPY --from=build-operator /opt/venv /opt/venv
WORKDIR /home/pstrain
USER 65532:65532
# Prometheus metrics and kopf's /healthz (PSTRAIN_OPERATOR_METRICS_PORT / _HEALTH_PORT).
EXPOSE 8080 8081
ENTRYPOINT ["pstrain", "operator"]

# ---------------------------------------------------------------------------------------
# Last, so that a plain `docker build .` gives the runtime image.
FROM base AS runtime
ARG TORCH_VARIANT=cpu
LABEL io.pstrain.torch-variant=${TORCH_VARIANT}
COPY --from=build-runtime /opt/venv /opt/venv
WORKDIR /home/pstrain
USER 65532:65532
# The replica port of every PS and worker (pstrain_api.constants.REPLICA_PORT).
EXPOSE 2222
ENTRYPOINT ["pstrain", "replica"]
