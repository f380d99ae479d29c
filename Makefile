# mqorder: `make test` and `make demo` work on a fresh machine (they install what they need).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-fast demo docs chaos bench lint install redis clean

$(STAMP): pyproject.toml setup.py mqorder/spark/_resp.c mqorder/store/_pack.c
	@command -v redis-server >/dev/null || { echo "installing redis-server"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }
	@command -v java >/dev/null || { echo "installing a Java 17 runtime for Spark"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless) >/dev/null; }
	@command -v chromium >/dev/null || { echo "installing chromium for the Flower browser test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; }
	@# Debian's prometheus package, for its promtool and prometheus binaries (tests/test_alert_rules.py and
	@# tests/test_prometheus_stack.py run them on free ports); a service it started on :9090 is stopped.
	@command -v promtool >/dev/null || { echo "installing prometheus (promtool) for the alert rule and Prometheus tests"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) >/dev/null; \
	  { command -v systemctl >/dev/null && systemctl disable --now -q prometheus; } >/dev/null 2>&1 || true; }
	@{ command -v docker-compose || docker compose version; } >/dev/null 2>&1 || { echo "installing docker-compose to validate docker-compose.yml"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose) >/dev/null; }
	@{ command -v dockerd && command -v debootstrap; } >/dev/null || { echo "installing docker.io and debootstrap for the compose stack test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap) >/dev/null; }
	@# RabbitMQ (Celery's other broker) runs as a service; Flower reads its queue lengths from the management API.
	@command -v rabbitmq-plugins >/dev/null && { rabbitmq-plugins list -e -m | grep -qx rabbitmq_management || \
	  { echo "enabling RabbitMQ's management plugin (Flower's RabbitMQ queue lengths)"; rabbitmq-plugins enable -q rabbitmq_management >/dev/null; }; } || true
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,spark,connect]'
	@touch $(STAMP)

install: $(STAMP)

# `make test` runs pytest on 2 pytest-xdist workers, each with its own redis-server, RabbitMQ
# vhosts, tmp dirs and Spark session. Measured on this 2-core machine with other work on it (load
# 2-7; 10 in the loadfile run), full suite of 639 tests: serial 8m14s (before); -n 2 --dist
# loadfile 8m59s; --dist loadgroup -n 2 5m20s, -n 3 5m21s, -n 4 4m57s (loadgroup ran as load:
# with pytest 9.2 and xdist 3.8 it did not keep an xdist_group on one worker); -n 2 --dist load
# 5m30s and 5m18s. --dist load, not loadfile: test_e2e.py alone is ~3.5 min of worker tests, so
# whole files leave one worker busy long after the other is done. -n 2, not 3 or 4: -n 4 was
# 20-30 s faster, inside this machine's run-to-run noise, but every worker that runs a Spark test
# starts a JVM of its own (1g heap), and 4 workers started 4; 2 workers bound the run to two.
# Since issue 29 (a Spark standalone cluster and a Connect server): --dist loadgroup with the
# scheduler of tests/xdist_schedule.py (tests/conftest.py), which runs every test needing those
# servers on one worker (one cluster, one Connect server per run) and hands out the slowest first.
# -n 3 since 2026-11-26: the suite (1,114 tests) waits more than it computes (JVM and worker starts,
# micro-batches, failovers): -n 2 took 18m19s on a quiet machine (CI), -n 3 9m39s with the machine
# 76 % busy on average over the run; each worker that runs a local Spark test starts one JVM.
PYTEST_WORKERS ?= 3
# --durations: the slowest tests in every CI log, to see where the ~10 minutes go.
PYTEST_PARALLEL := -n $(PYTEST_WORKERS) --dist loadgroup --durations=25
# The compose stack test's images (tests/test_compose_run.py) build in the background from the
# start of `make test`, beside lint and the other tests; the test waits on build_images.sh's lock
# and finds them built (on a machine that has them, the script returns at once).
IMAGES_LOG ?= /tmp/mqorder-test-images.log
SLOW_MARKERS := e2e or spark or browser or rabbitmq or chaos_smoke

test: $(STAMP)
	@(bash deploy/compose/ensure_docker.sh && MQORDER_IMAGE= BUILD_DEPS= bash deploy/compose/build_images.sh) \
	  >$(IMAGES_LOG) 2>&1 </dev/null &
	$(BIN)/ruff check mqorder workers tasks config tests bench chaos
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q
	$(BIN)/python -m pytest -q $(PYTEST_PARALLEL) tests

# Everything but the slow families (real worker subprocesses, Spark, Chromium, RabbitMQ, the chaos
# smoke): unit, property, Lua and engine tests against the suite's real redis-server. On the same
# xdist workers as `make test`: most of these tests wait on Redis (failovers, replicas, clusters
# starting), so 3 workers on 2 cores take 113 s where one took 293 s (1,336 tests, same machine,
# back to back, 2026-11-28).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "not ($(SLOW_MARKERS))" tests

# The docs site (mkdocs.yml) into site/; --strict: a broken link, anchor or API reference fails.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

demo: $(STAMP)
	$(BIN)/mqorder demo

chaos: $(STAMP)
	$(BIN)/python -m chaos

bench: $(STAMP)
	$(BIN)/python -m bench.run

lint: $(STAMP)
	$(BIN)/ruff check mqorder workers tasks config tests bench chaos
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build mqorder/spark/_resp*.so mqorder/store/_pack*.so
