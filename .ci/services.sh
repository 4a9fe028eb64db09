#!/usr/bin/env bash
# Start (up) or stop (down) every engine the test suite uses. Each engine's own script is idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
action=${1:-up}
for script in slurm/dev-cluster.sh docker/engine.sh; do
  if [ -x "$script" ] || [ -f "$script" ]; then
    echo "--- $script $action"
    bash "$script" "$action"
  fi
done
