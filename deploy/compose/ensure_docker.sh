#!/usr/bin/env bash
# A Docker engine and a compose client on this machine, or a clear error saying what failed.
#
# Installs Debian's docker.io, docker-compose (v1) and debootstrap when absent (as the Makefile
# does for the suite's other system packages), then starts dockerd when nothing answers on its
# socket. Meant for root on a Debian machine without systemd (CI sandboxes); on a laptop with
# Docker Desktop or a systemd dockerd it finds the engine running and does nothing.
#
# dockerd is started without iptables rules or the default bridge: the stack of the tests runs on
# host networking (deploy/compose/hostnet.yml), and sandboxes often forbid netfilter. overlay2 is
# tried first; vfs (slow, copies every layer, but needs no kernel support) if overlay2 fails.
# Its log is $DOCKERD_LOG (default /tmp/mqorder-dockerd.log).
set -euo pipefail

DOCKERD_LOG=${DOCKERD_LOG:-/tmp/mqorder-dockerd.log}

need() {  # need COMMAND PACKAGE...: install the Debian packages when COMMAND is missing
  local cmd=$1; shift
  command -v "$cmd" >/dev/null && return 0
  command -v apt-get >/dev/null || { echo "ensure_docker: $cmd is missing and there is no apt-get to install $*" >&2; exit 1; }
  echo "ensure_docker: installing $*" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"; } >/dev/null
}

engine_up() { docker info >/dev/null 2>&1; }

wait_engine() {  # wait_engine PID: 0 once the engine answers, 1 if dockerd exited or 60 s passed
  local pid=$1
  for _ in $(seq 1 120); do
    engine_up && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

start_dockerd() {  # start_dockerd DRIVER
  echo "ensure_docker: starting dockerd (storage driver $1, log $DOCKERD_LOG)" >&2
  # setsid: the daemon outlives the test session that started it, so the next run finds it up.
  # 9>&-: the daemon must not inherit the lock below, or it would hold it for its whole life.
  setsid dockerd --storage-driver="$1" --iptables=false --ip-masq=false --bridge=none \
    >>"$DOCKERD_LOG" 2>&1 < /dev/null 9>&- &
  local pid=$!
  if wait_engine "$pid"; then return 0; fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  return 1
}

# One session at a time installs and starts (two test sessions on a fresh machine would both find
# no engine, and the second dockerd would fail on the first one's pid file).
exec 9>/tmp/mqorder-ensure-docker.lock
flock -w 900 9 || { echo "ensure_docker: /tmp/mqorder-ensure-docker.lock is still held after 900 s (by: $(fuser /tmp/mqorder-ensure-docker.lock 2>&1))" >&2; exit 1; }
need dockerd docker.io
need docker-compose docker-compose
need debootstrap debootstrap
if ! engine_up; then
  [ "$(id -u)" = 0 ] || { echo "ensure_docker: no Docker engine answers and only root can start dockerd" >&2; exit 1; }
  if ! start_dockerd overlay2 && ! start_dockerd vfs; then
    echo "ensure_docker: dockerd did not start with overlay2 nor with vfs; the end of $DOCKERD_LOG:" >&2
    tail -n 30 "$DOCKERD_LOG" >&2
    exit 1
  fi
fi
docker version --format 'ensure_docker: engine {{.Server.Version}}' >&2
