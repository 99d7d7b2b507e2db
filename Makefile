# The README's two commands: `make demo` and `make test`. Each installs what it needs.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
AZURITE := node_modules/.bin/azurite-blob
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
STACK ?= prod
PYTEST_ARGS ?=

.PHONY: all install debs demo timeline-png test test-lowest test-requeue lint unit bench plan teardown clean

all: test

# Python environment: pyproject.toml's ranges at the exact versions of the lock, constraints.txt (the one
# place versions are pinned).
$(STAMP): pyproject.toml constraints.txt
	@$(PY) -m venv $(VENV) || { echo "error: could not create $(VENV) with $(PY) -m venv; install python3-venv" >&2; exit 1; }
	@$(BIN)/pip install -q --upgrade pip
	@$(BIN)/pip install -q -c constraints.txt -e '.[infra,demo,dev]' || { echo "error: pip could not install the packages pinned in constraints.txt; check access to PyPI (pip config list)" >&2; exit 1; }
	@touch $@

# Azurite from the npm registry, inside the project (node_modules/), never globally.
$(AZURITE): package.json package-lock.json
	@command -v npm >/dev/null || { echo "error: npm not found; install Node.js >= 18 (Debian: apt-get install nodejs npm)" >&2; exit 1; }
	@npm ci --no-audit --no-fund --loglevel=error || { echo "error: npm could not install Azurite (package.json) from the npm registry; check access to $$(npm config get registry)" >&2; exit 1; }
	@touch $@

# Debian packages: fio (storage benchmark), cloud-init (schema check of the rendered custom data),
# strace (the DCP writer test asserts that a save renames nothing), slurm-wlm + munge (the cluster
# tests start a real munged, slurmctld and slurmd; the daemons live in /usr/sbin, often not on PATH),
# shellcheck (`make lint` checks the node boot in scripts/).
debs:
	@missing=""; \
	command -v fio >/dev/null || missing="$$missing fio"; \
	command -v cloud-init >/dev/null || missing="$$missing cloud-init"; \
	command -v strace >/dev/null || missing="$$missing strace"; \
	command -v shellcheck >/dev/null || missing="$$missing shellcheck"; \
	{ command -v slurmctld || [ -x /usr/sbin/slurmctld ]; } >/dev/null || missing="$$missing slurm-wlm"; \
	{ command -v munged || [ -x /usr/sbin/munged ]; } >/dev/null || missing="$$missing munge"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null \
	  || { echo "error: apt-get could not install$$missing" >&2; exit 1; }; \
	fi

install: $(STAMP) $(AZURITE) debs

# The node boot (scripts/): shellcheck follows the sourced lib/boot-common.sh (-x).
SHELL_SCRIPTS := $(wildcard scripts/*.sh scripts/lib/*.sh)
# requires-python is >=3.10: the program and the toolkit must not need a newer Python (vermin, 3.10 floor).
VERMIN_ARGS = --target=3.10- --no-tips --violations --eval-annotations -q
# Dead code: everything is scanned so a name used only by tests or benchmarks counts as used;
# vulture_whitelist.py lists what only a framework calls.
VULTURE_PATHS = src components __main__.py tests benchmarks examples vulture_whitelist.py
lint: $(STAMP) debs
	shellcheck -x $(SHELL_SCRIPTS)
	$(BIN)/ruff check .
	$(BIN)/mypy
	PYTHONPATH=src:. $(BIN)/lint-imports
	$(BIN)/vermin $(VERMIN_ARGS) src components __main__.py
	$(BIN)/vulture $(VULTURE_PATHS) --min-confidence 60

# `make unit`: the fast subset a maintainer runs often (markers applied in tests/conftest.py), on two
# pytest-xdist workers;
# `make test`: lint and every test (requeue aside, see below), on two workers that each take whole
# modules (--dist loadfile: a module's fixtures - a built wheel, a Slurm, a mock run - start once).
# Many tests wait on ranks, daemons and timeouts, so two workers on two cores keep both busy.
UNIT_MARKS := not requeue and not slow and not benchmark and not network and not cluster
XDIST := -n 2 --dist loadfile
unit: install
	$(BIN)/pytest -n 2 -m '$(UNIT_MARKS)' $(PYTEST_ARGS)

test: install lint test-lowest
	$(BIN)/pytest $(XDIST) $(PYTEST_ARGS)

# The runtime dependencies at the lower bounds of their ranges (constraints-lowest.txt: numpy 1.26,
# pydantic 2.9, ...), installed over the locked environment (--target, first on PYTHONPATH), with the
# toolkit's tests that exercise them: what a training image with older packages gets.
LOWEST := .lowest-deps
LOWEST_TESTS := tests/toolkit/test_dependency_ranges.py tests/toolkit/test_save_load.py tests/toolkit/test_config_errors.py \
	tests/toolkit/test_config_rules.py tests/toolkit/test_dcp.py tests/lifecycle/test_logs.py \
	tests/lifecycle/test_lifecycle_local.py
test-lowest: install
	@rm -rf $(LOWEST) && $(BIN)/pip install -q --target $(LOWEST) --no-deps -r constraints-lowest.txt \
	  || { echo "error: pip could not install constraints-lowest.txt; check access to PyPI (pip config list)" >&2; exit 1; }
	TIERED_CKPT_LOWEST=1 PYTHONPATH=$(LOWEST):src:. $(BIN)/python -m pytest -p no:cacheprovider $(XDIST) $(PYTEST_ARGS) $(LOWEST_TESTS)

# The Slurm requeue test (USR1 at the time limit, `scontrol requeue`): timing-bound on a loaded
# 2-core machine, so outside `make test`.
test-requeue: install
	$(BIN)/pytest -m requeue tests/cluster

demo: $(STAMP) $(AZURITE)
	$(BIN)/python -m tiered_demo

# The README's timeline picture: the demo's lifecycle run with the toolkit's commands, drawn by
# `tiered-ckpt timeline --out docs/timeline.png`.
timeline-png: $(STAMP) $(AZURITE)
	$(BIN)/python -m tiered_demo.timeline --out docs/timeline.png

bench: install
	$(BIN)/python -m benchmarks

plan: $(STAMP)
	$(BIN)/python -m tiered_ops.preview --stack $(STACK)

teardown: $(STAMP)
	$(BIN)/python -m tiered_ops.teardown_cli --stack $(STACK) $(ARGS)

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache .ruff_cache .demo .demo-timeline .bench .lowest-deps
