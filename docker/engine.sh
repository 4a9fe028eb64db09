#!/usr/bin/env bash
# Start or stop a Docker engine on a machine without systemd (CI, dev boxes): `engine.sh up|down|status`.
# Idempotent: `up` returns at once when an engine already answers; every wait is bounded.
set -euo pipefail

DOCKER=${DOCKER:-/usr/bin/docker}  # Debian's 20.10 client: it has BuildKit; other clients on PATH may not
STATE_DIR=${DOCKER_ENGINE_STATE:-/var/run/k8s-engine}
LOG=$STATE_DIR/dockerd.log
PIDFILE=$STATE_DIR/dockerd.pid
UP_TIMEOUT_S=${DOCKER_UP_TIMEOUT_S:-60}

answers() { timeout 10 "$DOCKER" info >/dev/null 2>&1; }

install_if_missing() {
  if [[ -x /usr/sbin/dockerd && -x $DOCKER ]]; then return; fi
  echo "engine: installing docker.io" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends docker.io iptables tini >/dev/null
}

up() {
  install_if_missing
  if answers; then echo "engine: already up"; return; fi
  mkdir -p "$STATE_DIR"
  # setsid: the daemon outlives this shell and its job control; stop it with `engine.sh down`.
  setsid /usr/sbin/dockerd --pidfile "$PIDFILE" >"$LOG" 2>&1 </dev/null &
  local deadline=$((SECONDS + UP_TIMEOUT_S))
  until answers; do
    if ((SECONDS >= deadline)); then
      echo "engine: dockerd did not answer within ${UP_TIMEOUT_S}s; last log lines:" >&2
      tail -n 20 "$LOG" >&2 || true
      exit 1
    fi
    sleep 0.5
  done
  echo "engine: up in $((SECONDS))s ($("$DOCKER" version --format '{{.Server.Version}}'))"
}

down() {
  if [[ ! -f $PIDFILE ]]; then echo "engine: not started by this script"; return; fi
  local pid; pid=$(cat "$PIDFILE")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    local deadline=$((SECONDS + 30))
    while kill -0 "$pid" 2>/dev/null; do
      if ((SECONDS >= deadline)); then echo "engine: dockerd $pid ignored SIGTERM for 30s, killing" >&2; kill -KILL "$pid"; break; fi
      sleep 0.2
    done
  fi
  rm -f "$PIDFILE"
  echo "engine: down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) if answers; then echo up; else echo down; exit 1; fi ;;
  *) echo "usage: $0 up|down|status (start or stop a local dockerd)" >&2; exit 2 ;;
esac
