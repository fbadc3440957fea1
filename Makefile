# Every target builds the virtual environment first (once; again only when the lock changes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv test stress demo pe-demo bench lock clean

venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check pip==25.3
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.lock
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $@

# pytest exits 5 when it collected nothing; that is a failure here, not a pass.
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The kill -9 fault-injection test with 200 trials instead of make test's 20.
stress: $(STAMP)
	XLATRAIN_KILL_TRIALS=200 $(BIN)/python -m pytest -s -k kill_9 tests/train/test_resume.py

demo: $(STAMP)
	$(BIN)/xlatrain demo --run-dir runs/demo

# The PE-detection recipe on generated RSNA-shaped data, compared with the prior baseline.
pe-demo: $(STAMP)
	$(BIN)/python -m xlatrain.recipes.pe_detection.demo configs/pe_detection.yaml

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run --out benchmarks/results.json

# Re-resolve the pinned environment (needs the registry); commit the result.
lock:
	rm -rf /tmp/xlatrain-lock && $(PYTHON) -m venv /tmp/xlatrain-lock
	/tmp/xlatrain-lock/bin/pip install --quiet pip==25.3
	/tmp/xlatrain-lock/bin/pip install --quiet -e '.[xla,dev,bench]'
	/tmp/xlatrain-lock/bin/pip freeze --exclude-editable | grep -v '^xlatrain' > requirements.lock

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
