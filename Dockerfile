# syntax=docker/dockerfile:1
#
# One image for both parts of flexkv-operator: the console scripts
# `flexkv-operator` (the kopf operator) and `flexkv-agent` (the node agent).
# The chart runs `flexkv-operator`; the operator runs agents from the same
# image with `flexkv-agent run --config /etc/flexkv/agent.yaml`.
#
# CPU build (the default; CPU torch, embedded cache backend):
#   docker build -t flexkv-operator:0.1.0 .
#
# GPU build with FlexKV compiled from source (docs/helm.md, "GPU image"):
#   docker build \
#     --build-arg BASE_IMAGE=<CUDA devel image with python3 >= 3.11 and venv> \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg WITH_FLEXKV=true --build-arg FLEXKV_REF=<tag or branch> \
#     -t flexkv-operator:0.1.0-cuda .
# RUNTIME_IMAGE defaults to BASE_IMAGE; when set, it must carry the same
# python3 at the same path (the virtual environment is copied across).

ARG BASE_IMAGE=python:3.11.14-slim-bookworm
ARG RUNTIME_IMAGE=${BASE_IMAGE}

# ---------------------------------------------------------------- build ----
FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WITH_FLEXKV=false
ARG FLEXKV_REPO=https://github.com/taco-project/FlexKV
ARG FLEXKV_REF=main
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}

# torch first, from the index of the wanted build (CPU by default), so the
# project's own `torch` requirement is already met and never pulls CUDA wheels.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY node_agent/ node_agent/
COPY operator/ operator/
RUN pip install --no-cache-dir "./[agent,operator]" \
    && flexkv-operator --help >/dev/null \
    && flexkv-agent --help >/dev/null

# FlexKV is built from source against CUDA (its build.sh compiles the C++/CUDA
# parts and installs the package in editable mode, so the source tree is kept
# at /opt/FlexKV and copied into the runtime image). Without WITH_FLEXKV the
# directory stays empty and the agent uses its embedded backend.
# DL3003: build.sh must run from the FlexKV checkout.
# DL3008: build tools come from the base image's distribution at its versions.
# hadolint ignore=DL3003,DL3008
RUN mkdir -p /opt/FlexKV \
    && if [ "${WITH_FLEXKV}" = "true" ]; then \
         apt-get update \
         && apt-get install -y --no-install-recommends \
              git cmake build-essential liburing-dev libxxhash-dev \
         && rm -rf /var/lib/apt/lists/* \
         && git clone --depth 1 --branch "${FLEXKV_REF}" "${FLEXKV_REPO}" /opt/FlexKV \
         && cd /opt/FlexKV \
         && ./build.sh --release \
         && python -c "import flexkv"; \
       fi

# -------------------------------------------------------------- runtime ----
FROM ${RUNTIME_IMAGE} AS runtime
ARG WITH_FLEXKV=false
LABEL org.opencontainers.image.title="flexkv-operator" \
      org.opencontainers.image.description="Operator and node agent of a disaggregated KV cache for LLM inference" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# A fixed numeric user, so Kubernetes can verify runAsNonRoot without
# resolving names. FlexKV's shared libraries need liburing and libxxhash.
# DL3008: runtime libraries come from the base image's distribution.
# hadolint ignore=DL3008
RUN if [ "${WITH_FLEXKV}" = "true" ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends liburing2 libxxhash0 \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 flexkv \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp \
         --no-create-home --shell /usr/sbin/nologin flexkv

COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/FlexKV /opt/FlexKV

# HOME is /tmp so that caches land on the pod's writable emptyDir while the
# root filesystem stays read-only.
ENV PATH=/opt/venv/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/FlexKV/build/lib \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp

USER 10001:10001
WORKDIR /tmp
# 8080: agent HTTP (/healthz /readyz /status /metrics); 5557: agent PP
# fan-out; 8081: operator liveness (/healthz).
EXPOSE 8080 5557 8081
CMD ["flexkv-operator", "--help"]
