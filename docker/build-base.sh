#!/usr/bin/env bash
# Build a minimal Debian bookworm base image (python3 + venv) without any image registry:
# debootstrap from the Debian mirror apt already uses here, then `docker import`.
# Cached: does nothing when the image exists. Usage: build-base.sh [IMAGE]  (default local/bookworm-python:1)
set -euo pipefail

DOCKER=${DOCKER:-/usr/bin/docker}
IMAGE=${1:-local/bookworm-python:1}
SUITE=bookworm

if "$DOCKER" image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base: $IMAGE exists, skipping"; exit 0
fi

# The mirror apt uses: first `URIs:` of a deb822 .sources file, else the first `deb` line.
mirror() {
  local uri
  uri=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v security | head -n1 || true)
  if [[ -z $uri ]]; then
    uri=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' | grep -v security | head -n1 || true)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap >/dev/null; }
ROOT=$(mktemp -d /tmp/base-rootfs.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
MIRROR=$(mirror)
echo "base: debootstrap $SUITE from $MIRROR"
start=$SECONDS
debootstrap --variant=minbase --include=python3,python3-venv,tini,ca-certificates \
  "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 || { tail -n 30 "$ROOT.log" >&2; exit 1; }
rm -f "$ROOT.log"
# Slim the rootfs: apt lists and caches are not needed at run time.
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/* "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/*
tar -C "$ROOT" -c . | "$DOCKER" import -c 'ENV LANG=C.UTF-8' -c 'CMD ["/bin/bash"]' - "$IMAGE" >/dev/null
echo "base: $IMAGE built in $((SECONDS - start))s, $("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE") bytes"
