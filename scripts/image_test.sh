#!/usr/bin/env bash
# `make image-test`: build both images of the Dockerfile for real with buildah
# and check them (tests/image). Runs as root on Debian (CI); elsewhere it says
# loudly why it cannot run and exits 0.
#
# The public container registry is out of reach here, so the base image is made
# locally: mmdebstrap builds a Debian bookworm root file system with python3 and
# python3-venv, imported as localhost/flexkv-ci-base:bookworm and passed as
# BASE_IMAGE (the Dockerfile's default stays the official python image).
# Cached between runs: the base image (stamp .image-cache/base-<hash>) and the
# torch wheel. No --layers: with the vfs driver every cached layer is a full
# copy of the root file system, which made the agent build six times slower
# than one commit per stage; images a previous run left untagged are pruned.
# Figures (build seconds, image sizes) go to .image-cache/report.json.
set -euo pipefail
cd "$(dirname "$0")/.."

skip() {
  printf '\n!!!! IMAGE TEST SKIPPED: %s !!!!\n\n' "$*" >&2
  exit 0
}

[ "$(id -u)" = 0 ] || skip "needs root (buildah with the vfs driver, mmdebstrap, apt-get)"
if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then
  command -v apt-get >/dev/null || skip "buildah/mmdebstrap missing and no apt-get to install them"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah mmdebstrap
fi

bash scripts/bootstrap.sh
CACHE=.image-cache
SUITE=bookworm
# The Debian mirror: DEBIAN_MIRROR, else the first one this machine's apt uses.
host_mirror() {
  awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null \
    || true
  awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true
}
MIRROR="${DEBIAN_MIRROR:-$(host_mirror | head -1)}"
[ -n "$MIRROR" ] || skip "no Debian mirror: set DEBIAN_MIRROR"
BASE=localhost/flexkv-ci-base:$SUITE
OPERATOR_TAG=localhost/flexkv-operator:ci
AGENT_TAG=localhost/flexkv-agent:ci
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
# vfs works wherever the kernel refuses overlay mounts (nested containers);
# chroot isolation needs no user namespaces.
B=(buildah --storage-driver vfs)
export BUILDAH_ISOLATION=chroot
mkdir -p "$CACHE"

"${B[@]}" info >/dev/null 2>&1 || skip "buildah cannot run here: $("${B[@]}" info 2>&1 | tail -1)"

# ---- base image: Debian bookworm + python3 + venv (+ libstdc++ for torch, as
# in the python:*-slim images, + Mooncake's libibverbs1, libcurl4, libnuma1), no docs or locales
base_hash=$(printf '%s %s %s' "$SUITE" "$MIRROR" "$(sed -n '/^# ---- base image/,/^# ---- end base/p' "$0")" \
  | sha1sum | cut -c1-12)
stamp="$CACHE/base-$base_hash"
t0=$(date +%s)
if [ ! -f "$stamp" ] || ! "${B[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  rm -f "$CACHE"/base-* "$CACHE/rootfs.tar"
  mmdebstrap --variant=essential --include=python3,python3-venv,passwd,ca-certificates,libstdc++6,libibverbs1,libcurl4,libnuma1 \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    "$SUITE" "$CACHE/rootfs.tar" "$MIRROR"
  printf 'FROM scratch\nADD rootfs.tar /\nCMD ["python3"]\n' > "$CACHE/Containerfile.base"
  "${B[@]}" build --isolation chroot -f "$CACHE/Containerfile.base" -t "$BASE" "$CACHE"
  rm -f "$CACHE/rootfs.tar"
  touch "$stamp"
fi
# ---- end base
base_s=$(( $(date +%s) - t0 ))

# The CPU torch wheel, from pip's configured sources (download.pytorch.org may
# be out of reach): mounted into the agent build as TORCH_FIND_LINKS.
mkdir -p "$CACHE/wheels"
ls "$CACHE/wheels"/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1 || \
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps \
    -d "$CACHE/wheels" "torch==$TORCH_VERSION"
# Empty: pip's default index.
index=$(.venv/bin/python -m pip config get global.index-url 2>/dev/null || true)

# Builds see this machine's CA bundle (TLS-inspecting egress proxies) in place
# of the image's own, for the RUN steps only; nothing of it lands in a layer.
mounts=()
[ -f /etc/ssl/certs/ca-certificates.crt ] && \
  mounts+=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)

# The previous run's images, untagged by this run's builds (nothing on a fresh
# machine): pruned first, so repeated runs do not pile up full copies.
"${B[@]}" rmi --prune >/dev/null 2>&1 || true

build() {  # target tag extra-args...
  local target="$1" tag="$2"; shift 2
  "${B[@]}" build --isolation chroot --format docker --pull=never --target "$target" \
    --build-arg BASE_IMAGE="$BASE" "${mounts[@]}" "$@" -t "$tag" .
}
t0=$(date +%s)
build operator "$OPERATOR_TAG"
operator_s=$(( $(date +%s) - t0 ))
t0=$(date +%s)
build agent "$AGENT_TAG" -v "$PWD/$CACHE/wheels:/wheels:ro" \
  --build-arg TORCH_FIND_LINKS=/wheels --build-arg TORCH_INDEX_URL="$index"
agent_s=$(( $(date +%s) - t0 ))

size() { "${B[@]}" images --noheading --format '{{.Size}}' "$1"; }
cat > "$CACHE/report.json" <<JSON
{"base_image_seconds": $base_s, "operator_build_seconds": $operator_s,
 "agent_build_seconds": $agent_s,
 "operator_image_size": "$(size "$OPERATOR_TAG")", "agent_image_size": "$(size "$AGENT_TAG")"}
JSON
cat "$CACHE/report.json"

# shellcheck disable=SC1091
. .venv/bin/activate
FLEXKV_OPERATOR_IMAGE="$OPERATOR_TAG" FLEXKV_AGENT_IMAGE_UNDER_TEST="$AGENT_TAG" \
  BUILDAH_STORAGE_DRIVER=vfs python -m pytest tests/image -q -p no:cacheprovider

