# Two environments, each built once from its lock file (again only when the lock changes):
#   .venv      current torch, torchvision and torch_tpu (TorchTPU; dormant without a TPU)
#   .venv-xla  torch 2.9.0, torchvision 0.24.0 and torch_xla 2.9.0 (torch_xla's last release)
# They cannot be one: torch_xla runs only on torch 2.9.0, torch_tpu needs torch >= 2.11.
PYTHON   ?= python3
PIP_OPTS := --quiet --disable-pip-version-check
PIP_PIN  := $(shell grep '^pip==' requirements-tools.lock)
VENV     := .venv
VENV_XLA := .venv-xla
BIN      := $(VENV)/bin
XBIN     := $(VENV_XLA)/bin
PYTEST_ARGS ?=

# What `make lock` resolves: the newest torch that has a torchvision release made for it.
CURRENT_TOPS := torch==2.14.1 torchvision==0.29.2 '.[tpu,gcs,dev,bench,docs,models]'
XLA_TOPS     := '.[xla,dev,bench]'

.PHONY: venv venv-xla test test-current test-xla stress demo pe-demo bench docs lock clean

venv: $(VENV)/.installed $(VENV)/.site-hook
venv-xla: $(VENV_XLA)/.installed

# $(1) env dir, $(2) lock file. pip and uv come from requirements-tools.lock; uv installs the
# lock (the same packages pip would, unpacked in parallel and compiled to bytecode on every core:
# both environments built side by side took 99 s with pip, 79 s with uv, measured from empty caches).
define build_env
	@test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install $(PIP_OPTS) -r requirements-tools.lock
	$(1)/bin/uv pip install --quiet --python $(1)/bin/python --compile-bytecode -r $(2)
	$(1)/bin/uv pip install --quiet --python $(1)/bin/python --no-deps -e .
	@touch $(1)/.installed
endef

$(VENV)/.installed: requirements.lock requirements-tools.lock pyproject.toml
	$(call build_env,$(VENV),requirements.lock)

# The start-up hook that keeps the dormant TorchTPU of .venv quiet in every Python process on a
# machine without a TPU (see src/xlatrain/site_hook.py); a copy of hardware.py, so rewritten with it.
$(VENV)/.site-hook: $(VENV)/.installed src/xlatrain/backend/hardware.py src/xlatrain/site_hook.py
	$(BIN)/python -m xlatrain.site_hook install
	@touch $@

$(VENV_XLA)/.installed: requirements-xla.lock requirements-tools.lock pyproject.toml
	$(call build_env,$(VENV_XLA),requirements-xla.lock)

# Each test runs where its runtime lives: tests marked `xla` in .venv-xla, the rest in .venv.
# pytest exits 5 when it collected nothing; that is a failure here, not a pass. Each part lists
# its ten slowest tests, so that a test that grows slow is seen when it does. Bytecode for src/
# and tests/ is written first: where PYTHONDONTWRITEBYTECODE is set, each of the hundreds of
# processes the tests start would otherwise compile the package again (~0.1 CPU-s each, measured).
# The .venv part runs in TEST_WORKERS pytest-xdist workers, one per core of the 2-core machine:
# most of its time is fresh processes importing torch and training tiny models on one core, so a
# single worker left the other core idle (measured: CPU time = wall time over the whole part).
# --dist loadscope keeps a module's tests on one worker, so a module-scoped fixture (a finished run
# that several tests read) is still made once. The modules are handed out in the order they are
# collected (--no-loadscope-reorder: not by how many tests each has), which puts the longest first
# (tests/conftest.py, LONGEST_FIRST): by count, the docs' one-test module of 150-260 s ran last,
# with the other worker idle meanwhile. TEST_WORKERS=0 runs them one after another. The
# xla part runs in two workers as well: its tests are subprocesses that import torch_xla and
# compile for XLA:CPU mostly on one core (measured: 34 tests in 8 min 2 s in one worker, 5 min
# 31 s in two).
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder
test: test-current test-xla

test-current: $(VENV)/.installed $(VENV)/.site-hook
	$(BIN)/python -m compileall -q src tests
	$(BIN)/python -m pytest -m "not xla" --durations=10 $(XDIST) $(PYTEST_ARGS)

test-xla: $(VENV_XLA)/.installed
	$(XBIN)/python -m compileall -q src tests
	$(XBIN)/python -m pytest -m xla --durations=10 $(XDIST) $(PYTEST_ARGS)

# The kill -9 fault-injection test with 200 trials instead of make test's 20, and 80 DDP jobs
# that exit right after a gather (the abort at exit; none in make test).
stress: $(VENV)/.installed $(VENV)/.site-hook
	XLATRAIN_KILL_TRIALS=200 $(BIN)/python -m pytest -s -k kill_9 tests/train/test_resume.py
	XLATRAIN_EXIT_TRIALS=80 $(BIN)/python -m pytest -s -k never_abort_at_exit tests/train/test_distributed.py

demo: $(VENV)/.installed $(VENV)/.site-hook
	$(BIN)/xlatrain demo

# The PE-detection recipe on generated RSNA-shaped data, compared with the prior baseline.
pe-demo: $(VENV)/.installed $(VENV)/.site-hook
	$(BIN)/python -m xlatrain.recipes.pe_detection.demo configs/pe_detection.yaml --set trainer.run_dir=runs/pe-demo

# The documentation site (mkdocs.yml, pages in docs/) into build/site/: a broken link, an API
# reference that does not resolve or a page left out of the navigation fails the build.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

# Entries on the current torch run in .venv; the XLA ones start their workers in .venv-xla.
bench: $(VENV)/.installed $(VENV)/.site-hook $(VENV_XLA)/.installed
	XLATRAIN_XLA_PYTHON=$(CURDIR)/$(XBIN)/python $(BIN)/python -m benchmarks.run --out benchmarks/results.json

# Re-resolve both pinned environments (needs the registry); commit the results.
# Only pip goes into the resolving environment: uv there would be frozen into the locks.
lock:
	rm -rf /tmp/xlatrain-lock && $(PYTHON) -m venv /tmp/xlatrain-lock
	/tmp/xlatrain-lock/bin/pip install $(PIP_OPTS) $(PIP_PIN)
	/tmp/xlatrain-lock/bin/pip install $(PIP_OPTS) $(CURRENT_TOPS)
	$(PYTHON) tools/freeze_lock.py /tmp/xlatrain-lock/bin/python requirements.lock
	rm -rf /tmp/xlatrain-lock && $(PYTHON) -m venv /tmp/xlatrain-lock
	/tmp/xlatrain-lock/bin/pip install $(PIP_OPTS) $(PIP_PIN)
	/tmp/xlatrain-lock/bin/pip install $(PIP_OPTS) $(XLA_TOPS)
	$(PYTHON) tools/freeze_lock.py /tmp/xlatrain-lock/bin/python requirements-xla.lock
	rm -rf /tmp/xlatrain-lock

clean:
	rm -rf $(VENV) $(VENV_XLA) build src/*.egg-info .pytest_cache
