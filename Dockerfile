# mqorder: one image for every service of docker-compose.yml (worker, beat, flower, exporter, demo).
#
# Two stages: the build stage has a C compiler (for platforms where hiredis or orjson ship no
# binary wheel) and runs `pip install .` into a virtualenv; the runtime stage copies only that
# virtualenv onto a fresh base, so no compiler, header or pip cache is left in the image.
#
# The base is the official slim Python by default (what `docker compose up --build` pulls on a
# laptop). Where no image registry is reachable, BASE_IMAGE names a local Debian bookworm with
# python3 and python3-venv made from Debian packages (deploy/compose/base_image.sh builds it as
# mqorder-base:bookworm; docs/OPERATING.md, "Without an image registry"). Both have Python 3.11.

ARG PYTHON_VERSION=3.11
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim-bookworm

FROM ${BASE_IMAGE} AS build
# The compiler packages; empty ("") skips apt-get where every dependency has a binary wheel
# (x86_64 and aarch64 today), which saves the apt-get round trip of a cold build.
ARG BUILD_DEPS="gcc libc6-dev"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if [ -n "$BUILD_DEPS" ]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends $BUILD_DEPS \
      && rm -rf /var/lib/apt/lists/*; \
    fi
# python3, not python: the Debian base has no `python` (the official image has both).
RUN python3 -m venv /opt/mqorder
WORKDIR /src
# The dependencies first, read from pyproject.toml alone: a layer that stays cached while only the
# package's code changes, so a rebuild after a code change installs no dependency again. Wheels in
# deploy/compose/wheels/ are used first: deploy/compose/build_images.sh fills it from the host's
# pip (its index, proxy and certificates) and passes PIP_OPTS=--no-index, so the build needs no
# network; on a laptop the directory holds only its README and pip downloads from PyPI.
COPY pyproject.toml ./
COPY deploy/compose/wheels/ /wheels/
ARG PIP_OPTS=""
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
      > requirements.txt \
 && /opt/mqorder/bin/pip install $PIP_OPTS --find-links /wheels -r requirements.txt "setuptools>=68" wheel
COPY README.md setup.py ./
# Only the package: the checkout's workers/, tasks/ and config/ (the reference app) are not
# installed; the image runs the package's own stock app, mqorder.app. setup.py builds the two
# optional C extensions with the gcc above: mqorder.store._pack, which packs every round trip's
# commands (a trickling worker spends ~13 % fewer instructions with it), and the Spark readers'
# mqorder.spark._resp (small; the image runs no Spark). With BUILD_DEPS empty (`make test`'s
# build) or a base without Python's headers, both are skipped and hiredis packs instead. No
# build isolation: the build backend is already in the venv, so this step needs no network.
COPY mqorder ./mqorder
RUN /opt/mqorder/bin/pip install . --no-deps --no-build-isolation

FROM ${BASE_IMAGE} AS runtime
# A fixed numeric uid, so orchestrators can check runAsNonRoot without resolving a name.
RUN groupadd --system --gid 10001 mqorder \
 && useradd --system --uid 10001 --gid mqorder --home-dir /home/mqorder --create-home \
      --shell /usr/sbin/nologin mqorder
COPY --from=build /opt/mqorder /opt/mqorder
ENV PATH=/opt/mqorder/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /home/mqorder
USER 10001:10001
# The stock worker's health: it answers a ping on its own direct queue within 5 s (its node name is
# worker@<container hostname>, as CMD names it). docker-compose.yml gives every other service its
# own check; this one is for `docker run` of the image as it is.
HEALTHCHECK --interval=30s --timeout=15s --start-period=20s --retries=3 \
  CMD celery -A mqorder.app inspect ping -d "worker@$HOSTNAME" --timeout 5 >/dev/null || exit 1
# The stock worker; docker-compose.yml gives beat, flower, exporter and demo their own commands.
CMD ["celery", "-A", "mqorder.app", "worker", "-n", "worker@%h", "--loglevel=INFO"]
