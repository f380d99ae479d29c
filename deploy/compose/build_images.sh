#!/usr/bin/env bash
# The images of docker-compose.yml, built without an image registry when none is reachable.
#
#   deploy/compose/build_images.sh            # then: docker compose up -d (the printed variables in .env)
#
# Prints, on stdout, the variables that make docker-compose.yml use what it built:
#   MQORDER_IMAGE=mqorder:local            (the app image; with MQORDER_IMAGE= empty, its src- tag)
#   MQORDER_SOURCE_IMAGE=mqorder:src-<hash of its inputs>
#   REDIS_IMAGE=redis:7.2-alpine | mqorder-redis:bookworm
#   MQORDER_BASE_IMAGE=python:3.11-slim-bookworm | mqorder-base:bookworm
#
# The base: the official python:3.11-slim-bookworm when it is here or can be pulled; otherwise
# mqorder-base:bookworm, a Debian bookworm (python3 3.11, python3-venv) made by debootstrap from
# Debian's package mirror and `docker import`ed. Redis: the official redis:7.2-alpine likewise,
# otherwise mqorder-redis:bookworm, Debian's redis-server on that base (redis.Dockerfile).
#
# Every image is tagged by a hash of its inputs and built only when that tag is missing, so a
# second run on one machine builds nothing (the tests rely on it); when the package's code changed,
# Docker's layer cache still skips the dependency layer. Only the 3 newest mqorder:src-* are kept.
#
# Environment: MQORDER_IMAGE (extra tag of the app image, default mqorder:local; empty: none),
# BUILD_DEPS (the Dockerfile's compiler packages; default: the Dockerfile's), HOST_PYTHON (the
# interpreter whose pip collects the wheels; default: one of the base's Python version), DEBIAN_MIRROR
# (default http://deb.debian.org/debian), PYTHON_IMAGE, REDIS_OFFICIAL_IMAGE.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$ROOT/deploy/compose"
PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim-bookworm}
REDIS_OFFICIAL_IMAGE=${REDIS_OFFICIAL_IMAGE:-redis:7.2-alpine}
LOCAL_BASE=mqorder-base:bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
EXTRA_TAG=${MQORDER_IMAGE-mqorder:local}

log() { echo "build_images: $*" >&2; }
have() { docker image inspect "$1" >/dev/null 2>&1; }
# Present, or pulled now. An unresolvable registry fails the pull at once (0.3 s here); one whose
# packets are dropped would hang, hence the bound.
present_or_pulled() { have "$1" || timeout 120 docker pull -q "$1" >/dev/null 2>&1; }

# One build at a time per engine: concurrent test runs wait here, then find the tags made.
lock_name=${DOCKER_HOST:-default}
exec 9>"/tmp/mqorder-build-images.${lock_name//[^A-Za-z0-9]/_}.lock"
flock -w 1500 9 || { log "the build lock is still held after 1500 s"; exit 1; }

local_base() {
  have "$LOCAL_BASE" && return 0
  command -v debootstrap >/dev/null || { log "no $PYTHON_IMAGE and no debootstrap to make a base (apt-get install debootstrap)"; exit 1; }
  local dir
  dir=$(mktemp -d /tmp/mqorder-base.XXXXXX)
  log "making $LOCAL_BASE with debootstrap from $DEBIAN_MIRROR (a cold machine's longest step)"
  if ! debootstrap --variant=minbase --include=python3,python3-venv bookworm "$dir" "$DEBIAN_MIRROR" >"$dir.log" 2>&1; then
    tail -n 20 "$dir.log" >&2; rm -rf "$dir" "$dir.log"; exit 1
  fi
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir.log"
  # debootstrap writes the release only; the images built on it get security and point updates too.
  printf 'deb %s bookworm-updates main\ndeb http://deb.debian.org/debian-security bookworm-security main\n' \
    "$DEBIAN_MIRROR" >>"$dir/etc/apt/sources.list"
  tar -C "$dir" -c . | docker import \
    -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'CMD ["python3"]' -m "debootstrap bookworm minbase + python3, python3-venv" - "$LOCAL_BASE" >/dev/null
  rm -rf "$dir"
}

if present_or_pulled "$PYTHON_IMAGE"; then base=$PYTHON_IMAGE; else local_base; base=$LOCAL_BASE; fi
base_id=$(docker image inspect -f '{{.Id}}' "$base")

# -- wheels of the dependencies, from the host's pip (the build itself needs no network) -----------
WHEELS=$HERE/wheels
# Resolved for the base's own Python, binary wheels only (every dependency has one). pip's
# --python-version picks the wheels but evaluates markers with the interpreter that runs it
# (redis needs async-timeout below 3.11.3, as on Debian's 3.11.2), so a host interpreter of the
# base's exact version is preferred (Debian's /usr/bin/python3 for the Debian base).
base_python=$(docker run --rm --network none --entrypoint python3 "$base" -c 'import platform; print(platform.python_version())')
HOST_PYTHON=${HOST_PYTHON:-}
if [ -z "$HOST_PYTHON" ]; then
  for py in /usr/bin/python3 "$(command -v python3 || true)" "$ROOT/.venv/bin/python"; do
    [ -x "$py" ] && [ "$("$py" -c 'import platform; print(platform.python_version())')" = "$base_python" ] \
      && "$py" -m pip --version >/dev/null 2>&1 && { HOST_PYTHON=$py; break; }
  done
  HOST_PYTHON=${HOST_PYTHON:-$ROOT/.venv/bin/python}
fi
deps_hash=$( { sha256sum "$ROOT/pyproject.toml"; echo "$base_python $(uname -m) $HOST_PYTHON"; } | sha256sum | cut -c1-16)
if [ "$(cat "$WHEELS/.stamp" 2>/dev/null)" != "$deps_hash" ]; then
  log "collecting the dependencies' wheels for Python $base_python into $WHEELS with $HOST_PYTHON -m pip"
  rm -f "$WHEELS"/*.whl "$WHEELS/.stamp"
  # Every manylinux tag glibc 2.36 (bookworm) runs: pip matches --platform tags exactly.
  platforms=()
  for tag in manylinux1 manylinux2010 manylinux2014 $(seq -f 'manylinux_2_%g' 5 36); do
    platforms+=(--platform "${tag}_$(uname -m)")
  done
  reqs=$(mktemp)
  python3 -c "import tomllib; print('\n'.join(tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['dependencies']))" >"$reqs"
  "$HOST_PYTHON" -m pip download -q --dest "$WHEELS" --only-binary=:all: --python-version "$base_python" \
    --implementation cp "${platforms[@]}" -r "$reqs" "setuptools>=68" wheel >&2
  rm -f "$reqs"
  echo "$deps_hash" >"$WHEELS/.stamp"
fi

# -- the app image: Dockerfile + what it copies + the base it is built on -------------------------
app_hash=$(cd "$ROOT" && {
  echo "$base_id ${BUILD_DEPS-default}"
  find Dockerfile .dockerignore pyproject.toml README.md mqorder deploy/compose/wheels -type f \
    ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum
} | sha256sum | cut -c1-16)
app=mqorder:src-$app_hash
if ! have "$app"; then
  log "building $app on $base"
  args=(--build-arg "BASE_IMAGE=$base" --build-arg "PIP_OPTS=--no-index")
  [ -n "${BUILD_DEPS+x}" ] && args+=(--build-arg "BUILD_DEPS=$BUILD_DEPS")
  build_log=$(mktemp /tmp/mqorder-build-app.XXXXXX)
  DOCKER_BUILDKIT=0 docker build --network host "${args[@]}" -t "$app" "$ROOT" >"$build_log" 2>&1 \
    || { tail -n 40 "$build_log" >&2; exit 1; }
  rm -f "$build_log"
  # Keep the 3 newest source tags (other checkouts' runs may still use them), drop the rest.
  docker image ls mqorder --format '{{.CreatedAt}}|{{.Tag}}' | grep '|src-' | sort -r | tail -n +4 \
    | cut -d'|' -f2 | while read -r tag; do docker rmi "mqorder:$tag" >/dev/null 2>&1 || true; done
fi
[ -n "$EXTRA_TAG" ] && docker tag "$app" "$EXTRA_TAG"

# -- Redis ----------------------------------------------------------------------------------------
if [ "$base" = "$PYTHON_IMAGE" ] && present_or_pulled "$REDIS_OFFICIAL_IMAGE"; then
  redis_image=$REDIS_OFFICIAL_IMAGE
else
  redis_hash=$(cd "$HERE" && { echo "$base_id"; sha256sum redis.Dockerfile redis-entrypoint.sh; } | sha256sum | cut -c1-16)
  redis_image=mqorder-redis:src-$redis_hash
  if ! have "$redis_image"; then
    log "building $redis_image (Debian's redis-server) on $base"
    build_log=$(mktemp /tmp/mqorder-build-redis.XXXXXX)
    DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE_IMAGE=$base" -f "$HERE/redis.Dockerfile" \
      -t "$redis_image" "$HERE" >"$build_log" 2>&1 \
      || { tail -n 40 "$build_log" >&2; exit 1; }
    rm -f "$build_log"
  fi
  docker tag "$redis_image" mqorder-redis:bookworm
fi

echo "MQORDER_IMAGE=${EXTRA_TAG:-$app}"
echo "MQORDER_SOURCE_IMAGE=$app"
echo "REDIS_IMAGE=$redis_image"
echo "MQORDER_BASE_IMAGE=$base"
