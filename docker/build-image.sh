#!/usr/bin/env bash
# Build the training image. Usage: build-image.sh [--local] [IMAGE]   (default IMAGE torchlaunch:dev)
#   --local  no image registry and no TLS: base from docker/build-base.sh, wheels from a wheelhouse
#            (docker/wheelhouse.sh) served on 127.0.0.1 to a --network host build. What CI uses.
#   default  the Dockerfile's public CUDA PyTorch base and pip's configured registries (real clusters).
# Prints the build time and image size. Needs a running engine (docker/engine.sh up).
set -euo pipefail
cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-/usr/bin/docker}   # Debian's client: BuildKit works through it; set DOCKER elsewhere
export DOCKER_BUILDKIT=1

local_build=0
if [[ ${1:-} == --local ]]; then local_build=1; shift; fi
IMAGE=${1:-torchlaunch:dev}
BASE_LOCAL=${BASE_LOCAL:-local/bookworm-python:1}
VERSION=${VERSION:-$(git describe --tags --always 2>/dev/null || echo 0.0.0)}
GIT_SHA=${GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}

"$DOCKER" info >/dev/null 2>&1 || { echo "build-image: no Docker engine answers; start one with docker/engine.sh up" >&2; exit 2; }

args=(--build-arg "VERSION=$VERSION" --build-arg "GIT_SHA=$GIT_SHA" -f docker/Dockerfile -t "$IMAGE")
server_pid=
cleanup() { if [[ -n $server_pid ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; }
trap cleanup EXIT

if ((local_build)); then
  docker/build-base.sh "$BASE_LOCAL"
  docker/wheelhouse.sh .cache/wheelhouse
  # A fixed port: the URL is a build arg, part of the dependency layer's cache key.
  port=${WHEELHOUSE_PORT:-38421}
  if python3 -c "import socket,sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', $port)) != 0)"; then
    echo "build-image: port $port is taken; free it or set WHEELHOUSE_PORT to a free port" >&2; exit 2
  fi
  python3 -m http.server --bind 127.0.0.1 --directory .cache/wheelhouse "$port" >/dev/null 2>&1 &
  server_pid=$!
  deadline=$((SECONDS + 15))
  until python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=2)" 2>/dev/null; do
    ((SECONDS < deadline)) || { echo "build-image: wheelhouse server did not start on port $port" >&2; exit 1; }
    sleep 0.2
  done
  args+=(--network host --build-arg "BASE_IMAGE=$BASE_LOCAL" --build-arg "WHEELHOUSE_URL=http://127.0.0.1:$port/")
fi

start=$(date +%s%N)
"$DOCKER" build "${args[@]}" .
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
size_mb=$(($("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE") / 1000000))
echo "build-image: $IMAGE built in ${elapsed_ms} ms, ${size_mb} MB"
