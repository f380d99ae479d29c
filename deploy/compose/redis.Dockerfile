# The Redis service's image where no image registry is reachable: Debian bookworm's redis-server
# (7.0) on the local base (build context: this directory), tagged mqorder-redis:bookworm by
# deploy/compose/build_images.sh and used with REDIS_IMAGE=mqorder-redis:bookworm. On a laptop,
# docker-compose.yml pulls redis:7.2-alpine instead.
#
# What it keeps of the official image: the server runs as the unprivileged `redis` user in /data
# (a volume), and protected mode is off, because containers reach it from other addresses (the
# compose network); the official image does the same in its entrypoint.

ARG BASE_IMAGE=mqorder-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
COPY redis-entrypoint.sh /usr/local/bin/redis-entrypoint
VOLUME /data
WORKDIR /data
USER redis
ENTRYPOINT ["/usr/local/bin/redis-entrypoint"]
CMD ["redis-server"]
HEALTHCHECK --interval=5s --timeout=3s --retries=10 --start-period=5s \
  CMD redis-cli ping | grep -q PONG
