# cogni gateway — every target sets itself up; all steps are idempotent.
# Fresh Debian 12 as root: `make demo`, `make test`.

SHELL := /bin/bash
# The system's python3 (Debian 12's 3.11), the interpreter `make install` puts the
# service on: the suite tests and the benchmarks time what an operator runs. A python3
# found first on PATH may be another build (this machine's pyenv one, compiled without
# --enable-optimizations, starts and runs gatewayd's Python 10-25% slower:
# docs/performance.md, eighth round). PYTHON=... overrides.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3) python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The lint tools' own virtualenv (pyproject.toml's `lint` extra, without gatewayd's
# dependencies): import-linter reads the source, it never imports gatewayd.
LINT_VENV ?= .venv-lint
LINT_STAMP := $(LINT_VENV)/.installed
# Debian packages the product and its tests need. Installed only when missing.
#   bubblewrap      the sandbox (mount/pid/user namespaces)
#   libcap-dev      headers for python-prctl (the benchmarks' dev extra)
#   libseccomp-dev  seccomp filters for the sandbox
#   python3-venv, python3-dev, gcc: the virtualenv, gatewayd's sandbox launcher (C) and
#                   building python-prctl
#   git, curl, iproute2: real repositories and probes in the integration tests
#   openssl         test certificates for the egress proxy's TLS origins
#   libcap2-bin     capsh: gatewayd run as a non-root user with ambient capabilities
#   systemd         systemd-analyze (unit checks) and systemd-sysusers (dry runs)
#   systemd-container  systemd-nspawn: the end-to-end test boots a real systemd in a
#                   box (tests/systemdbox.py) and runs the installed service under it
#   nodejs          the official MCP TypeScript SDK's client in the tests (its engines:
#                   node >=18; Debian 12 has 18.20). npm: see node-packages
APT_PACKAGES := bubblewrap libcap-dev libseccomp-dev python3-venv python3-dev gcc git curl iproute2 busybox-static \
  openssl libcap2-bin systemd systemd-container nodejs
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# litellm must never fetch its price map at import.
export LITELLM_LOCAL_MODEL_COST_MAP := True

# The npm packages the tests run (tests/mcp_node: the MCP TypeScript SDK's client), from
# the committed package-lock.json, into tests/mcp_node/node_modules.
NODE_DIR := tests/mcp_node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed

.PHONY: setup system-packages node-packages venv launcher tools demo test test-fast lint typecheck check bench clean \
  install uninstall bench-anchors bench-anchors-install

setup: system-packages venv launcher node-packages

# gatewayd's sandbox launcher (gatewayd/sandbox/launcher.c: the step between gatewayd and
# bwrap for each command), compiled beside its source: the checkout's gatewayd runs it
# there, and `make install`'s wheel carries it (pyproject.toml's package-data). Written
# under a temporary name and renamed, so an interrupted build never leaves a partial one.
LAUNCHER := gatewayd/sandbox/gatewayd-launcher
launcher: $(LAUNCHER)

$(LAUNCHER): gatewayd/sandbox/launcher.c
	@echo "==> compiling $@"
	@# 0755 whatever root's umask: a non-root gatewayd user runs it (docs/operations.md)
	cc -O2 -Wall -Wextra -Werror -Wconversion -Wno-sign-conversion -o $@.tmp $<
	chmod 0755 $@.tmp
	mv -f $@.tmp $@

system-packages:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "==> installing Debian packages:$$missing"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	else echo "==> Debian packages present"; fi

# Debian's npm only when no npm is there: NodeSource's nodejs carries its own npm and
# conflicts with Debian's.
node-packages: system-packages $(NODE_STAMP)

$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	@command -v npm >/dev/null || { echo "==> installing Debian package: npm"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm; }
	@echo "==> installing $(NODE_DIR)'s npm packages from its package-lock.json"
	cd $(NODE_DIR) && npm ci --no-audit --no-fund --loglevel=error
	@touch $(NODE_STAMP)

venv: $(STAMP)

# The interpreter .venv is to be made from (empty: $(PYTHON) does not run), and the one
# its pyvenv.cfg says it was made from (read, not run: that one may be gone). A
# virtualenv of another interpreter, or of none that is there, is made again: its stamp
# then counts as out of date, whatever its time. One interpreter start per make.
VENV_WANTED := $(if $(strip $(PYTHON)),$(shell $(PYTHON) -c 'import os, sys; print(os.path.realpath(sys.executable))' 2>/dev/null))
VENV_MADE_FROM := $(shell sed -n 's/^executable = //p' $(VENV)/pyvenv.cfg 2>/dev/null | head -n 1 | xargs -r readlink -f)
ifneq ($(wildcard $(VENV)/pyvenv.cfg),)
ifneq ($(VENV_MADE_FROM),$(VENV_WANTED))
.PHONY: $(STAMP)
endif
endif

$(STAMP): pyproject.toml Makefile
	@echo "==> creating virtualenv $(VENV) from pyproject.toml with $(PYTHON)"
	@[ -n "$(VENV_WANTED)" ] || { \
	  echo "make: PYTHON='$(PYTHON)' does not run: apt-get install python3 python3-venv, or set PYTHON= to a python3" >&2; exit 1; }
	@if [ -e $(VENV) ] && [ "$(VENV_MADE_FROM)" != "$(VENV_WANTED)" ]; then \
	  echo "==> $(VENV) was made from $(or $(VENV_MADE_FROM),an interpreter that is gone), not $(VENV_WANTED): making it again"; \
	  rm -rf $(VENV); fi
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	@touch $(STAMP)

# The example tools (examples/tools/<name>/, docs/tool-runners.md): each C source
# compiled to a wasm32-wasi module beside its manifest by zig's clang, from the ziglang
# wheel of the dev extra (no toolchain installed by hand). A module is rebuilt only when
# its source or the shared header changes; it is written under a temporary name and
# renamed, so an interrupted build never leaves a truncated module that looks current.
# The first build ever also builds zig's WASI libc into its cache (~/.cache/zig): ~30 s.
# The shared header (examples/include/cogni_tool.h: the protocol) lies outside the tool
# directory, which holds tool folders only (`gatewayd tools check` reports anything else).
TOOLS_DIR := examples/tools
TOOL_INCLUDE := examples/include
TOOL_MODULES := $(patsubst %.c,%.wasm,$(wildcard $(TOOLS_DIR)/*/*.c))
TOOL_HEADERS := $(wildcard $(TOOL_INCLUDE)/*.h)
TOOL_CFLAGS := -O2 -s -std=gnu11 -Wall -Wextra -Werror -I$(TOOL_INCLUDE)

# What a build needs first: the dev virtualenv (ziglang). The test suite's fixture
# builds with TOOL_NEEDS= and its own interpreter (PY=...), so a pytest run never
# re-makes the virtualenv it runs from.
TOOL_NEEDS ?= $(STAMP)

tools: $(TOOL_MODULES)

$(TOOLS_DIR)/%.wasm: $(TOOLS_DIR)/%.c $(TOOL_HEADERS) | $(TOOL_NEEDS)
	$(PY) -m ziglang cc --target=wasm32-wasi $(TOOL_CFLAGS) -o $@.$$$$.tmp $< && mv $@.$$$$.tmp $@

demo: setup tools
	$(VENV)/bin/python demo/run_demo.py

# pytest exits 5 when it collected no test: that fails here like any other failure.
# The whole suite runs the lint first: a broken layer fails CI like a failing test.
# Two workers (pytest-xdist): most tests wait (sandboxes start, daemons flush the audit
# log, subprocesses run), so two halve the suite's time on two cores; every test makes
# its own state directory, network namespaces and uid range, so they run side by side.
# Python keeps the bytecode it compiles, whatever PYTHONDONTWRITEBYTECODE says: the suite
# starts hundreds of gatewayd processes, and each would compile every gatewayd module it
# imports again (about 0.5 s a daemon here) and each worker rewrite every test's asserts.
# Every Hypothesis property at its full count, whatever the shell's environment says.
test: setup lint tools
	env -u PYTHONDONTWRITEBYTECODE -u COGNI_TEST_EXAMPLES_SCALE $(PY) -m pytest -q -n 2 --durations=25

# The edit-test loop: the unit tests of the pure layers and of each module alone (no
# sandbox, no daemon, no network namespace), under a minute. Bytecode kept as for `test`:
# about 4 s of CPU a worker at every run otherwise. __pycache__ is git-ignored.
# Two things only `make test` runs in full, so this stays under a minute on two cores:
# the Hypothesis properties try a tenth of their examples here (at least 10 each:
# tests/hypothesis_counts.py), and the tests marked fresh_interpreter (a new interpreter
# per test, to see what a gatewayd command imports or what systemd hands it: 31 tests,
# a tenth of this lane's CPU) are left out. `make test` and CI run all of them, every
# property at its full count. A passing test's tmp_path is removed when it ends, in the
# workers, instead of a whole earlier session's (5,000 directories) by pytest's main
# process after the last test (3 s); a failing test's is kept, as before.
FAST_EXAMPLES_SCALE ?= 0.1
test-fast: setup
	env -u PYTHONDONTWRITEBYTECODE COGNI_TEST_EXAMPLES_SCALE=$(FAST_EXAMPLES_SCALE) \
	  $(PY) -m pytest -q -n auto -m "not fresh_interpreter" \
	  -o tmp_path_retention_policy=failed tests/unit

$(LINT_STAMP): pyproject.toml Makefile
	@echo "==> creating virtualenv $(LINT_VENV) for the lint tools (pyproject.toml's lint extra)"
	@[ -x $(LINT_VENV)/bin/python ] || $(PYTHON) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/python -m pip install -q --upgrade pip
	$(LINT_VENV)/bin/python -m pip install -q $$($(LINT_VENV)/bin/python -c \
	  'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["lint"]))')
	@touch $(LINT_STAMP)

# import-linter checks the layers and that no import cycle exists (contracts in
# pyproject.toml; lint/import_contracts.py adds the module-level cycle check, tested
# first). It reads the source found on PYTHONPATH; gatewayd is not installed there.
lint: setup $(LINT_STAMP)
	$(VENV)/bin/ruff check gatewayd cogni_tool tests bench demo lint examples
	$(VENV)/bin/ruff format --check gatewayd cogni_tool tests bench demo lint examples
	PYTHONPATH=$(CURDIR) $(LINT_VENV)/bin/python -m pytest -q -p no:cacheprovider \
	  -W ignore::pytest.PytestConfigWarning lint  # pyproject's pytest options are the suite's
	PYTHONPATH=$(CURDIR) $(LINT_VENV)/bin/lint-imports --no-logo --no-cache

typecheck: setup $(LINT_STAMP)
	$(VENV)/bin/mypy
	MYPYPATH=bench $(VENV)/bin/mypy bench  # the benchmarks import bench/harness.py as harness
	$(VENV)/bin/mypy --strict --python-executable $(LINT_VENV)/bin/python lint

check: lint typecheck test

bench: setup
	$(PY) bench/gateway_rtt.py
	$(PY) bench/cli_cold.py
	$(PY) bench/cli_start.py
	$(PY) bench/audit_cost.py
	$(PY) bench/sandbox_launch.py
	$(PY) bench/review_overhead.py
	$(PY) bench/model_overhead.py
	$(PY) bench/metrics_cost.py
	$(PY) bench/workspace.py
	$(PY) bench/app_overhead.py
	$(PY) bench/mcp_overhead.py
	$(PY) bench/tool_runners.py
	$(PY) bench/many_runs.py
	$(PY) bench/anchors.py --prefix $(ANCHORS_PREFIX)

# The anchors bench/anchors.py sets gatewayd beside: other agent sandboxes from npm, in a
# prefix of their own outside the checkout (srt also needs socat and ripgrep).
ANCHORS_PREFIX ?= /opt/cogni-anchors
ANCHOR_APT_PACKAGES := socat ripgrep

bench-anchors-install: system-packages
	@missing=""; for p in $(ANCHOR_APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; fi
	npm install --prefix $(ANCHORS_PREFIX) --no-audit --no-fund --loglevel=error \
	  @openai/codex @anthropic-ai/sandbox-runtime

bench-anchors: setup
	$(PY) bench/anchors.py --prefix $(ANCHORS_PREFIX)

clean:
	rm -rf $(VENV) $(LINT_VENV) $(NODE_DIR)/node_modules .pytest_cache .mypy_cache .ruff_cache $(LAUNCHER) $(LAUNCHER).tmp

# The service's installation (docs/operations.md, "Install"): a wheel of this checkout in
# $(PREFIX)/venv, a virtualenv of the SYSTEM interpreter (the service user must be able
# to run it, and the unit hides /home, /root and /tmp: never a pyenv or the checkout's
# .venv), the docs the unit names beside it, then `gatewayd install-systemd` (the unit,
# the socket, the system user, /etc/gatewayd). Again: the same version is reinstalled
# over itself, the operator's /etc/gatewayd kept. DESTDIR stages it for a package: the
# scripts' #! lines name $(PREFIX), not the staging directory.
PREFIX ?= /opt/gatewayd
DESTDIR ?=
SYSTEM_PYTHON ?= /usr/bin/python3
INSTALL_VENV := $(DESTDIR)$(PREFIX)/venv
# What the wheel is built from (copied out first: two builds at once in one checkout, as
# in the tests' boxes, would share setuptools' build/ directory otherwise).
WHEEL_SOURCES := pyproject.toml README.md gatewayd cogni_tool policies systemd

install: launcher
	@[ "$$($(SYSTEM_PYTHON) -c 'import sys; print(sys.prefix)' 2>/dev/null)" = /usr ] || { \
	  echo "make install: $(SYSTEM_PYTHON) is not the system's python3 (Debian: apt-get install python3 python3-venv)" >&2; exit 1; }
	@# umask 022 on every line that makes files: root's umask may be 077 (CIS-hardened
	@# hosts), and the gatewayd user must read the venv and the docs (install-systemd
	@# refuses a venv it cannot search)
	@umask 022; set -euo pipefail; build=$$(mktemp -d /tmp/gatewayd-wheel.XXXXXX); trap 'rm -rf "$$build"' EXIT; \
	[ -x $(INSTALL_VENV)/bin/python ] || { echo "==> creating $(INSTALL_VENV) with $(SYSTEM_PYTHON)"; \
	  $(SYSTEM_PYTHON) -m venv $(INSTALL_VENV); }; \
	echo "==> building the wheel of $(CURDIR)"; \
	tar -c --exclude=__pycache__ $(WHEEL_SOURCES) | tar -x -C "$$build/"; \
	$(INSTALL_VENV)/bin/python -m pip wheel -q --no-deps -w "$$build/dist" "$$build"; \
	wheel=$$(ls "$$build"/dist/cogni_gateway-*.whl); \
	echo "==> installing $$(basename $$wheel) and its dependencies into $(INSTALL_VENV)"; \
	$(INSTALL_VENV)/bin/python -m pip install -q --use-pep517 "$$wheel"; \
	$(INSTALL_VENV)/bin/python -m pip install -q --force-reinstall --no-deps "$$wheel"
	@if [ -n "$(DESTDIR)" ]; then \
	  grep -rlIF "$(INSTALL_VENV)" $(INSTALL_VENV)/bin | xargs -r sed -i "s|$(INSTALL_VENV)|$(PREFIX)/venv|g"; fi
	umask 022; rm -rf $(DESTDIR)$(PREFIX)/docs && cp -r docs $(DESTDIR)$(PREFIX)/docs
	@# -P: the installed gatewayd, not the checkout's (python -m would look in . first)
	umask 022; $(INSTALL_VENV)/bin/python -P -m gatewayd.cli install-systemd --root $(or $(DESTDIR),/) \
	  --program $(PREFIX)/venv/bin/gatewayd

# Stops and disables the service, removes the virtualenv, the docs and the units; keeps
# the configuration, the state (runs' data, the audit log) and the gatewayd user.
uninstall:
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then \
	  systemctl disable --now gatewayd.socket gatewayd.service 2>/dev/null || true; fi
	rm -rf $(DESTDIR)$(PREFIX)/venv $(DESTDIR)$(PREFIX)/docs
	rm -f $(DESTDIR)/etc/systemd/system/gatewayd.service $(DESTDIR)/etc/systemd/system/gatewayd.socket \
	  $(DESTDIR)/etc/tmpfiles.d/gatewayd.conf
	@rmdir $(DESTDIR)$(PREFIX) 2>/dev/null || true
	@if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
	@echo "==> kept: /etc/gatewayd (configuration), /var/lib/gatewayd and /var/lib/gatewayd-agent (state, the audit log), the gatewayd user (/etc/sysusers.d/gatewayd.conf); remove them by hand if they are not wanted"
