# `make demo` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-full build check clean gpu-check

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/bamgen build --all -o generated
	$(PY) examples/demo.py

# The whole suite but the aot_full and full parts (8-16 minutes of tests on 2 cores, by machine);
# test-full adds them (the rest of the AOT compile matrix, the positional one included, the
# long forms of the training studies, inductor on an HF model: much longer).
test: $(STAMP)
	$(PY) -m pytest -q -n auto -m "not aot_full and not full" tests

test-full: $(STAMP)
	$(PY) -m pytest -q -n auto tests

build: $(STAMP)
	$(VENV)/bin/bamgen build --all -o generated

check: $(STAMP)
	$(VENV)/bin/bamgen build --all -o generated --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# On a CUDA machine, in an environment that already has torch, triton, pytest and hypothesis
# (pytest-xdist used if present; no venv: a GPU user keeps their own CUDA build of torch): the
# property tests and the shipped priors' Triton checks with CUDA tensors, the AOT checks for the
# local GPU family and benchmarks/gpu.py, whose table goes to docs/results/gpu/<device>-<date>.md;
# under 10 minutes. Without a GPU it
# says so in one line and exits 0. GPU_BENCH_ARGS replaces the benchmark's sizes
# (benchmarks/gpu_check.py says which); GPU_CHECK_ARGS passes other options to it (--skip,
# --limit, --archive FILE.tar.gz).
GPU_BENCH_ARGS ?=
GPU_CHECK_ARGS ?=
gpu-check:
	@$(PYTHON) benchmarks/gpu_check.py $(if $(GPU_BENCH_ARGS),--bench-args "$(GPU_BENCH_ARGS)") $(GPU_CHECK_ARGS)
