# mqorder: one image for every service of docker-compose.yml (worker, beat, flower, exporter, demo).
#
# Two stages: the build stage has a C compiler (for platforms where hiredis or orjson ship no
# binary wheel) and runs `pip install .` into a virtualenv; the runtime stage copies only that
# virtualenv onto a fresh slim Python, so no compiler, header or pip cache is left in the image.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/mqorder
WORKDIR /src
COPY pyproject.toml README.md ./
# Only the package: the checkout's workers/, tasks/ and config/ (the reference app) are not
# installed; the image runs the package's own stock app, mqorder.app.
COPY mqorder ./mqorder
RUN /opt/mqorder/bin/pip install .

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
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
# The stock worker; docker-compose.yml gives beat, flower, exporter and demo their own commands.
CMD ["celery", "-A", "mqorder.app", "worker", "-n", "worker@%h", "--loglevel=INFO"]
