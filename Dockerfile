# syntax=docker/dockerfile:1
#
# Two images from one Dockerfile, one per console script:
#   target `operator`: `flexkv-operator` (the kopf operator) with the
#       `operator` extra only; no torch, no pyzmq (about 200 MB).
#   target `agent` (the default, last stage): `flexkv-agent` (the node agent)
#       with the `agent` and `remote` extras and torch, CPU build unless told
#       otherwise. The `remote` extra (Mooncake Store, docs/remote.md) also
#       carries `mooncake_master`: a pool's managed master runs this image.
# The chart runs the operator image; the operator runs the agent image on every
# node of a pool with `flexkv-agent run --config /etc/flexkv/agent.yaml`.
#
# CPU images (the defaults):
#   docker build --target operator -t flexkv-operator:0.1.0 .
#   docker build --target agent    -t flexkv-agent:0.1.0 .
#
# Agent with CUDA torch (the wheel index of the wanted CUDA release):
#   docker build --target agent \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     -t flexkv-agent:0.1.0-cuda .
#
# Agent with FlexKV compiled from source (docs/helm.md, "GPU image"):
#   docker build --target agent \
#     --build-arg BASE_IMAGE=<CUDA devel image with python3 >= 3.11 and venv> \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg WITH_FLEXKV=true --build-arg FLEXKV_REF=<tag or branch> \
#     -t flexkv-agent:0.1.0-cuda .
#
# BASE_IMAGE is any Debian-like image with python3 >= 3.11 and its venv module
# (CI builds from a Debian bookworm root file system made with mmdebstrap,
# scripts/image_test.sh). RUNTIME_IMAGE defaults to BASE_IMAGE; when set, it
# must carry the same python3 at the same path (the venv is copied across).

ARG BASE_IMAGE=python:3.11.14-slim-bookworm
ARG RUNTIME_IMAGE=${BASE_IMAGE}

# ------------------------------------------------------- operator build ----
FROM ${BASE_IMAGE} AS build-operator
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY node_agent/ node_agent/
COPY operator/ operator/
# The operator extra alone: the smoke check proves the command needs nothing
# from the agent or dev extras. pip and setuptools are not needed at run time.
RUN pip install --no-cache-dir "./[operator]" \
    && flexkv-operator --help >/dev/null \
    && pip uninstall --yes --quiet pip setuptools

# ---------------------------------------------------------- agent build ----
FROM ${BASE_IMAGE} AS build-agent
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A folder holding a torch wheel, mounted into the build (buildah build
# -v /wheels:/wheels:ro); empty means the index alone.
ARG TORCH_FIND_LINKS=""
ARG WITH_FLEXKV=false
ARG FLEXKV_REPO=https://github.com/taco-project/FlexKV
ARG FLEXKV_REF=main
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:${PATH}

# torch first, from the index of the wanted build (CPU by default), so the
# agent extra's `torch` requirement is already met and never pulls CUDA wheels.
# DL3013: torch is pinned; hadolint misreads the optional --find-links value.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} \
      ${TORCH_FIND_LINKS:+--find-links "${TORCH_FIND_LINKS}"} "torch==${TORCH_VERSION}"

# The CPU row kernel's streaming-store library (node_agent/backend/_rowcopy.c)
# is compiled by the install below when a C compiler is present; without one the
# install still succeeds and rows are copied with numpy (docs/backend.md). The
# compiler stays in this build stage. A base without apt-get and without gcc
# (CI's mmdebstrap base) builds without the library.
# DL3008: build tools come from the base image's distribution at its versions.
# hadolint ignore=DL3008
RUN if ! command -v gcc >/dev/null && command -v apt-get >/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends gcc libc6-dev \
      && rm -rf /var/lib/apt/lists/*; \
    fi

WORKDIR /src
COPY pyproject.toml README.md ./
COPY node_agent/ node_agent/
COPY operator/ operator/
RUN pip install --no-cache-dir "./[agent,remote]" \
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

# ------------------------------------------------------ common runtime ----
FROM ${RUNTIME_IMAGE} AS runtime
LABEL org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A fixed numeric user, so Kubernetes can verify runAsNonRoot without
# resolving names.
RUN groupadd --system --gid 10001 flexkv \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp \
         --no-create-home --shell /usr/sbin/nologin flexkv
# HOME is /tmp so that caches land on the pod's writable emptyDir while the
# root filesystem stays read-only.
ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
WORKDIR /tmp

# ------------------------------------------------------------ operator ----
FROM runtime AS operator
LABEL org.opencontainers.image.title="flexkv-operator" \
      org.opencontainers.image.description="kopf operator of a disaggregated KV cache for LLM inference"
COPY --from=build-operator /opt/venv /opt/venv
USER 10001:10001
# 8081: operator liveness (/healthz).
EXPOSE 8081
ENTRYPOINT ["flexkv-operator"]
CMD ["--help"]

# --------------------------------------------------------------- agent ----
FROM runtime AS agent
ARG WITH_FLEXKV=false
LABEL org.opencontainers.image.title="flexkv-agent" \
      org.opencontainers.image.description="Node agent of a disaggregated KV cache for LLM inference"
# Mooncake (the remote tier: its client and mooncake_master) loads
# libibverbs.so.1, libcurl.so.4 and libnuma.so.1; FlexKV's shared libraries
# need liburing and libxxhash. A base that already carries them (the CI base
# is built with them by mmdebstrap, which has no apt-get) needs no apt step.
# DL3008: runtime libraries come from the base image's distribution.
# hadolint ignore=DL3008,SC2086
RUN pkgs="libibverbs1 libcurl4 libnuma1"; \
    if [ "${WITH_FLEXKV}" = "true" ]; then pkgs="$pkgs liburing2 libxxhash0"; fi; \
    missing=""; \
    for p in $pkgs; do \
      dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; \
    done; \
    if [ -n "$missing" ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends $missing \
      && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=build-agent /opt/venv /opt/venv
COPY --from=build-agent /opt/FlexKV /opt/FlexKV
ENV LD_LIBRARY_PATH=/opt/FlexKV/build/lib
USER 10001:10001
# 8080: agent HTTP (/healthz /readyz /status /metrics); 5557: PP fan-out;
# 17500-17501: the remote tier's Mooncake transfer engine (storePort, storePort+1).
EXPOSE 8080 5557 17500 17501
ENTRYPOINT ["flexkv-agent"]
CMD ["--help"]
