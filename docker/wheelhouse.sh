#!/usr/bin/env bash
# Fill a local wheelhouse (default .cache/wheelhouse) with every wheel the image needs, pinned by
# constraints.txt, using this machine's pip configuration (its registries, local indexes and CA).
# The image build then installs from it over http://127.0.0.1 with --no-index: no registry, no TLS.
# Re-running only fetches what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.cache/wheelhouse}
PYTHON=${PYTHON:-python3}
mkdir -p "$DEST"
reqs=$(mktemp); trap 'rm -f "$reqs"' EXIT
"$PYTHON" docker/project_deps.py pyproject.toml live >"$reqs"  # the image's extras: the Dockerfile's
echo "setuptools" >>"$reqs"   # build backend for `pip install .` inside the image (no index there)
# Skip pip (which re-resolves over the network, ~20 s) when the inputs have not changed.
stamp="$DEST/.inputs.sha256"
digest=$(cat "$reqs" constraints.txt | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$digest" ]]; then
  echo "wheelhouse: up to date ($(ls "$DEST" | wc -l) wheels)"; exit 0
fi
start=$SECONDS
"$PYTHON" -m pip download --quiet --progress-bar off --only-binary=:all: --dest "$DEST" -c constraints.txt -r "$reqs" 2> >(grep -v "is ignored: it is neither" >&2)
echo "$digest" >"$stamp"
echo "wheelhouse: $(ls "$DEST" | wc -l) wheels, $(du -sh "$DEST" | cut -f1), $((SECONDS - start))s"
