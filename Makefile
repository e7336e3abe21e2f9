# `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test build check clean gpu-check

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

# On a CUDA machine, in an environment that already has torch, triton, pytest, pytest-xdist and
# hypothesis (no venv: a GPU user keeps their own CUDA build of torch). The property tests of
# the Triton backend with CUDA tensors against the float64 reference, then the GPU benchmark.
GPU_BENCH_ARGS ?=
gpu-check:
	BAMGEN_TEST_DEVICE=cuda TRITON_INTERPRET=0 $(PYTHON) -m pytest -q -n 8 -p no:cacheprovider \
		tests/test_properties.py -k "triton or hard_case"
	$(PYTHON) benchmarks/gpu.py $(GPU_BENCH_ARGS)
