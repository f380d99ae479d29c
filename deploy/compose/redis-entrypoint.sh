#!/bin/sh
# `redis-server ARGS`: the server with protected mode off (it is reached from other containers),
# then the caller's own ARGS, which may set it back. Anything else (redis-cli, sh) runs as given.
set -e
if [ "$1" = "redis-server" ]; then
  shift
  exec redis-server --protected-mode no "$@"
fi
exec "$@"
