# torchlaunch: one entry point for installing, training, testing and benchmarking.
PYTHON_BOOT ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
GPUS ?= 1
CONFIG ?= configs/cifar10.yaml
ARGS ?=
PYTEST_ARGS ?=

.PHONY: install install-live train-local test test-all test-unit test-integration test-extended faults test-fast lint docs format bench doctor preflight image k8s-manifests clean

# Idempotent: re-runs only when pyproject.toml, constraints.txt or the optional C extension's sources
# (setup.py: the JPEG window decoder, built in place by the editable install) changed.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt setup.py torchlaunch/worker/data/_jpeg_window.c
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test,plot]'
	touch $@

# Live recovery (recovery.live) needs torchft's Lighthouse, a dependency of the package: `install` has
# it; install-live stays for the commands that name it.
install-live: install

# make exits 2 whenever a recipe fails, whatever the launcher returned: the launcher's own code (the
# README's exit-code table: 75 = run the same command again, 2 = bad input) is said on the last line.
train-local: install
	$(info $(PY) -m launch.local --gpus $(GPUS) --config $(CONFIG) $(ARGS))
	@$(PY) -m launch.local --gpus $(GPUS) --config $(CONFIG) $(ARGS) || { rc=$$?; \
	  echo "make: launch.local exited $$rc (the README's exit codes are the launcher's; make's own is 2)" >&2; \
	  exit $$rc; }

# The suite lives on three floors: tests/unit (in-process only, enforced by tests/unit/conftest.py),
# tests/integration (processes on this machine: launchers, torchrun, loopback) and tests/engines (the
# Slurm cluster, dockerd, the scanners, network namespaces). `make test` is CI's: the unit floor first,
# so a unit failure shows in minutes, then integration and engines. test-extended holds the end-to-end
# variants past CI's 35-minute budget (docs/testing.md says what and why); test-all = test + extended.
# In-process and quick tests run on JOBS pytest workers; the slow and engine tests one at a time: each
# already keeps both cores busy with its ranks, and side by side they measured only 13% faster while
# load-sensitive deadlines (a 5 s hang watchdog) misfired and two Slurm jobs competed for two nodes.
JOBS ?= 2
test: test-unit test-integration

test-all: test test-extended

test-unit: install
	$(PY) -m pytest -q -n $(JOBS) tests/unit $(PYTEST_ARGS)

# Both stages run whatever the first one's result (a failure there must not hide the second stage's);
# the recipe fails with the first stage's code when it failed, else the second's.
test-integration: install
	rc=0; \
	$(PY) -m pytest -q -n $(JOBS) -m "not slow and not slurm and not docker and not netns and not extended" tests/integration tests/engines $(PYTEST_ARGS) || rc=$$?; \
	$(PY) -m pytest -q -m "(slow or slurm or docker) and not netns and not extended" tests/integration tests/engines $(PYTEST_ARGS) || { c=$$?; [ $$rc -ne 0 ] || rc=$$c; }; \
	exit $$rc

# A developer's quick loop across the floors: everything not marked slow and needing no engine.
test-fast: install
	$(PY) -m pytest -q -n $(JOBS) -m "not slow and not slurm and not docker and not scanners and not netns and not extended" $(PYTEST_ARGS)

test-extended: install
	rc=0; \
	$(PY) -m pytest -q -m "extended and not netns" $(PYTEST_ARGS) || rc=$$?; \
	$(PY) -m pytest -q -m "extended and netns" tests/engines/faults $(PYTEST_ARGS) || { c=$$?; [ $$rc -ne 0 ] || rc=$$c; }; \
	exit $$rc

# The multi-node fault-injection suite (root, network namespaces): its own CI stage.
faults: install
	rm -rf runs/faults
	FAULTS_RESULTS_DIR=runs/faults $(PY) -m pytest -q -m "netns and not extended" tests/engines/faults $(PYTEST_ARGS)
	$(PY) -m faults.report --from runs/faults

LINT_PATHS := torchlaunch launch train tests bench faults examples

# ruff format is enforced: `make format` rewrites, `make lint` fails on any unformatted file.
lint: install
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)
	$(MAKE) --no-print-directory docs

# The documentation site (mkdocs.yml, docs/): --strict fails on a broken link, anchor or nav entry.
# Built into the git-ignored site/; `mkdocs serve` previews it.
docs: install
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

format: install
	$(PY) -m ruff format $(LINT_PATHS)
	$(PY) -m ruff check --fix $(LINT_PATHS)

doctor: install
	$(PY) -m train.doctor $(ARGS)

preflight: install
	$(PY) -m launch.local --doctor --gpus $(GPUS) --config $(CONFIG) $(ARGS)

bench: install
	$(PY) -m bench.run

IMAGE ?= torchlaunch:dev
# Real clusters: public CUDA PyTorch base + pip's registries. LOCAL=1: no registry (debootstrapped base, local wheelhouse).
image:
	docker/build-image.sh $(if $(LOCAL),--local) $(IMAGE)

# k8s/job.yaml is exactly the default rendering (a golden test checks it).
k8s-manifests: install
	$(PY) -m launch.k8s --dry-run > k8s/job.yaml

clean:
	rm -rf runs site .pytest_cache .ruff_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
