# One entry point for set-up, tests, demo and benchmarks.
# `make test` / `make demo` build .venv on first use; later runs reuse it.
VENV      ?= .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 2

.PHONY: setup test demo bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@# Reuse a torch the system already has (e.g. a CUDA build on a GPU box); else install one.
	if python3 -c "import torch" 2>/dev/null; then \
		python3 -m venv --system-site-packages $(VENV); \
	else \
		python3 -m venv $(VENV) && $(PY) -m pip install -q "$(TORCH_SPEC)"; \
	fi
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q triton ninja
	@# Without --no-build-isolation pip pulls a multi-GB CUDA torch into DeepSpeed's build env.
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation "deepspeed>=0.16"
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m lomo_kernels.demo

bench: $(STAMP)
	$(PY) bench/bench_update.py
	$(PY) bench/memory.py --all

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
