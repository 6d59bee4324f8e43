# cogni gateway — every target sets itself up; all steps are idempotent.
# Fresh Debian 12 as root: `make demo`, `make test`.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Debian packages the product and its tests need. Installed only when missing.
#   bubblewrap      the sandbox (mount/pid/user namespaces)
#   libcap-dev      headers for python-prctl
#   libseccomp-dev  seccomp filters for the sandbox
#   python3-venv, python3-dev, gcc: the virtualenv and building python-prctl
#   git, curl, iproute2: real repositories and probes in the integration tests
#   openssl         test certificates for the egress proxy's TLS origins
#   libcap2-bin     capsh: gatewayd run as a non-root user with ambient capabilities
#   systemd         systemd-analyze (unit checks) and systemd-sysusers (dry runs)
APT_PACKAGES := bubblewrap libcap-dev libseccomp-dev python3-venv python3-dev gcc git curl iproute2 busybox-static \
  openssl libcap2-bin systemd
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# litellm must never fetch its price map at import.
export LITELLM_LOCAL_MODEL_COST_MAP := True

.PHONY: setup system-packages venv demo test test-fast lint typecheck check bench clean

setup: system-packages venv

system-packages:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "==> installing Debian packages:$$missing"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "==> Debian packages present"; fi

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "==> creating virtualenv $(VENV) from pyproject.toml"
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/python demo/run_demo.py

# pytest exits 5 when it collected no test: that fails here like any other failure.
# The whole suite runs the lint first: a broken layer fails CI like a failing test.
test: setup lint
	$(PY) -m pytest -q

# The edit-test loop: the unit tests of the pure layers and of each module alone (no
# sandbox, no daemon, no network namespace), under a minute.
test-fast: setup
	$(PY) -m pytest -q tests/unit

# import-linter checks the layers and that no import cycle exists (contracts in
# pyproject.toml; lint/import_contracts.py adds the module-level cycle check).
lint: setup
	$(VENV)/bin/ruff check gatewayd cogni_tool tests bench demo lint
	$(VENV)/bin/ruff format --check gatewayd cogni_tool tests bench demo lint
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-logo --no-cache

typecheck: setup
	$(VENV)/bin/mypy

check: lint typecheck test

bench: setup
	$(PY) bench/gateway_rtt.py
	$(PY) bench/cli_cold.py
	$(PY) bench/audit_cost.py
	$(PY) bench/sandbox_launch.py
	$(PY) bench/review_overhead.py
	$(PY) bench/model_overhead.py
	$(PY) bench/metrics_cost.py
	$(PY) bench/workspace.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
