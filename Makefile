# `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test build check clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/bamgen build --all -o generated
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q -n auto tests

build: $(STAMP)
	$(VENV)/bin/bamgen build --all -o generated

check: $(STAMP)
	$(VENV)/bin/bamgen build --all -o generated --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
