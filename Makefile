# mqorder: `make test` and `make demo` work on a fresh machine (they install what they need).
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo docs chaos bench lint install redis clean

$(STAMP): pyproject.toml
	@command -v redis-server >/dev/null || { echo "installing redis-server"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null; }
	@command -v java >/dev/null || { echo "installing a Java 17 runtime for Spark"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless) >/dev/null; }
	@command -v chromium >/dev/null || { echo "installing chromium for the Flower browser test"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null; }
	@{ command -v docker-compose || docker compose version; } >/dev/null 2>&1 || { echo "installing docker-compose to validate docker-compose.yml"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose) >/dev/null; }
	@# RabbitMQ (Celery's other broker) runs as a service; Flower reads its queue lengths from the management API.
	@command -v rabbitmq-plugins >/dev/null && { rabbitmq-plugins list -e -m | grep -qx rabbitmq_management || \
	  { echo "enabling RabbitMQ's management plugin (Flower's RabbitMQ queue lengths)"; rabbitmq-plugins enable -q rabbitmq_management >/dev/null; }; } || true
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,spark]'
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check mqorder workers tasks config tests bench chaos
	$(BIN)/mypy
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q
	$(BIN)/python -m pytest -q tests

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
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
