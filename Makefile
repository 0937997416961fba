# One entry point for set-up, tests, demo and benchmarks.
# `make test` / `make demo` build .venv on first use; later runs reuse it.
VENV      ?= .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
export OMP_NUM_THREADS ?= 2
# A benchmark piped into tee fails the target when it fails.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

BENCH_1B_BATCH ?= 4
BENCH_7B_BATCH ?= 1
BENCH_GPU := bench-gpu-kernels bench-gpu-memory bench-gpu-single-backward bench-gpu-head \
	bench-gpu-24gib bench-gpu-train-1b bench-gpu-train-7b

.PHONY: setup test test-gpu test-compile-versions demo bench bench-suite bench-gpu $(BENCH_GPU) \
	gpu-wheels gpu-setup gpu-check lint docs clean

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

# Two pytest-xdist workers, one file each at a time (module fixtures run once), one thread
# each: most tests are single-threaded Python (Triton interpreter, Dynamo tracing), so two
# workers use both cores. Files go out in collection order, the slowest first (conftest.py),
# so the two longest start at once instead of ending the run.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# On a CUDA machine, every test that can use a GPU: those marked `cuda` (every backend on CUDA
# tensors against the float64 model, the optimizers end to end, the no-host-sync check) and
# every test taking the `test_device` fixture (conftest marks them `cuda`), which
# LOMO_TEST_DEVICE=cuda moves onto the GPU. Skipped with the reason elsewhere.
# TRITON_INTERPRET=0: Triton compiles real GPU kernels instead of interpreting them.
test-gpu: $(GPU_STAMP)
	$(GPU_ENV) LOMO_TEST_DEVICE=cuda $(PY) -m pytest -q -m cuda -rs tests

# A GPU box whose python3 already holds a CUDA torch, triton and transformers, offline (a
# lent machine): `make gpu-wheels` beforehand, where PyPI is reachable, fetches the
# pure-Python packages it lacks into $(GPU_WHEELS); there, `make gpu-setup` installs them
# into that python3 from the folder, and `make test-gpu bench-gpu-... GPU_PY=python3` runs the
# tree in place (PYTHONPATH, no build of the package: its extensions compile on first use).
GPU_WHEELS    ?= .gpu-wheels
GPU_PACKAGES  := lomo-optim liger-kernel cut-cross-entropy
GPU_PY        ?=
ifeq ($(GPU_PY),)
GPU_STAMP     := $(STAMP)
else
PY            := $(GPU_PY)
GPU_STAMP     :=
endif
GPU_ENV       := PYTHONPATH=$(CURDIR) TRITON_INTERPRET=0
RESULTS       ?= bench/results

gpu-wheels:
	python3 -m pip download -q --no-deps -d $(GPU_WHEELS) $(GPU_PACKAGES)

gpu-setup:
	$(if $(GPU_PY),,$(error give the box's python: make gpu-setup GPU_PY=python3))
	$(GPU_PY) -c "import torch, triton, transformers; assert torch.cuda.is_available(), 'no CUDA device'"
	$(GPU_PY) -m pip install -q --no-index --no-deps --find-links $(GPU_WHEELS) $(GPU_PACKAGES)

# The GPU paths in one command, sized for one lent machine's 10-minute command: the gpu_smoke
# tests, then `bench.train` (a 1B shape; Llama-3-8B capped at 24 GiB with the fused head and
# without), `bench.head`, `bench.host_time` and `bench.quality` on the device, each part in
# processes of its own under its own time budget: 9 minutes in all, the C++/CUDA extensions'
# first build included. summary.md, results.json and the log go to RESULTS (here by default
# bench/results/gpu-check) as each part ends. DEVICE=cpu runs the same at tiny sizes.
DEVICE            ?= cuda
GPU_CHECK_RESULTS := $(if $(filter file,$(origin RESULTS)),bench/results/gpu-check,$(RESULTS))
gpu-check: $(GPU_STAMP)
	$(GPU_ENV) $(PY) -m bench.gpu_check --device $(DEVICE) --results $(GPU_CHECK_RESULTS)

# The compile tests on each torch version that compiled autograd is tested on (the package's
# TESTED_TORCH_VERSIONS; TORCH_VERSIONS="2.13.0" picks some), each in a venv of its own
# (.venv-torch-<version>) with that version's CPU wheel (TORCH_PIP_ARGS: where pip finds it).
# Not part of `make test`: each version is a separate install and a full run of the slowest
# tests.
TORCH_PIP_ARGS  ?= --extra-index-url https://download.pytorch.org/whl/cpu
COMPILE_TESTS   ?= tests/compile
test-compile-versions: $(STAMP)
	set -e; \
	versions="$${TORCH_VERSIONS:-$$($(PY) -c 'from lomo_kernels.compile import TESTED_TORCH_VERSIONS as v; print(*v)')}"; \
	for version in $$versions; do \
		venv=.venv-torch-$$version; \
		echo "== torch $$version ($$venv)"; \
		[ -x $$venv/bin/python ] || python3 -m venv $$venv; \
		$$venv/bin/python -m pip install -q $(TORCH_PIP_ARGS) "torch==$$version"; \
		$$venv/bin/python -m pip install -q setuptools wheel triton ninja; \
		$$venv/bin/python -m pip install -q --no-build-isolation -e ".[test]"; \
		$$venv/bin/python -c "import torch; assert torch.__version__.split('+')[0] == '$$version', torch.__version__"; \
		$$venv/bin/python -m pytest -q -p no:cacheprovider $(COMPILE_TESTS); \
	done

# The demo (bench/demo.py): a line per phase with its expected time; within three minutes on
# an idle 2-core CPU from a fresh clone, the C++ kernels' first build included.
demo: $(STAMP)
	$(PY) -m bench.demo --plot demo.png

# Every benchmark lives in bench/ (outside the package) and runs from the clone's root as
# `python -m bench.<study>`; `python -m bench` lists the studies.
# CPU figures of BENCHMARKS.md (CPU timings, never GPU ones): kernels, memory, end to end.
bench: $(STAMP)
	$(PY) -m bench.kernels --csv bench/results/kernels_cpu.csv \
		--plot bench/results/kernels_cpu.png
	$(PY) -m bench.memory --model llama-168m \
		--plot bench/results/memory_cpu.png
	$(PY) -m bench.train --model tiny --steps 5 --rounds 3 \
		--optimizers adamw,sgd,lomo_optim,lomo,lomo_single,adalomo,adalomo_single,lomo_compiled_autograd \
		--json bench/results/train_cpu.json --plot bench/results/train_cpu.png \
		| tee bench/results/train_cpu.txt
	$(PY) -m bench.update

# The kernel cases of `bench.kernels` as a pytest-benchmark suite (bench/test_bench_kernels.py;
# LOMO_BENCH_DEVICE=cuda on a GPU, LOMO_BENCH_SIZES=4K,1M to choose the sizes).
bench-suite: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider bench/test_bench_kernels.py --benchmark-only

# The GPU figures of BENCHMARKS.md: tables on stdout, JSON/CSV and plots in $(RESULTS). One
# target per table, each a few minutes on one H100 (a lent machine runs at most 10 minutes
# per command); `bench-gpu` runs them all.
bench-gpu: $(BENCH_GPU)

bench-gpu-kernels: $(GPU_STAMP)
	$(GPU_ENV) $(PY) -m bench.kernels --device cuda \
		--csv $(RESULTS)/kernels_cuda.csv --json $(RESULTS)/kernels_cuda.json \
		--plot $(RESULTS)/kernels_cuda.png | tee $(RESULTS)/kernels_cuda.txt

bench-gpu-memory: $(GPU_STAMP)
	$(GPU_ENV) $(PY) -m bench.memory --device cuda --model llama-168m --batch 4 \
		--seq 512 \
		--optimizers adamw,sgd,lomo_optim,lomo,lomo_clip,adalomo,lomo_compiled_forward,lomo_compiled_autograd \
		--json $(RESULTS)/memory_cuda.json --plot $(RESULTS)/memory_cuda.png \
		| tee $(RESULTS)/memory_cuda.txt
	@# The same with the logits-free loss (the fused head and embedding).
	$(GPU_ENV) $(PY) -m bench.memory --device cuda --model llama-168m --batch 4 \
		--seq 512 --optimizers sgd,lomo,adalomo --fused-head \
		--json $(RESULTS)/memory_cuda_fused_head.json | tee $(RESULTS)/memory_cuda_fused_head.txt

bench-gpu-single-backward: $(GPU_STAMP)
	$(GPU_ENV) $(PY) -m bench.single_backward --device cuda --steps 20 --batch 8 \
		--seq 256 --threads 4 | tee $(RESULTS)/single_backward_cuda.txt

# The LM head alone (Llama-3-8B's 128,256 x 4096 at 8 x 2048 tokens), beside liger-kernel and
# cut-cross-entropy (installed without dependencies: they must not replace torch; on an
# offline box `make gpu-setup` has installed them).
bench-gpu-head: $(GPU_STAMP)
	$(PY) -c "import liger_kernel, cut_cross_entropy" 2>/dev/null || \
		$(PY) -m pip install -q --no-deps liger-kernel cut-cross-entropy
	$(GPU_ENV) $(PY) -m bench.head --device cuda --shape llama-3-8b \
		--dtype bf16 --steps 10 --warmup 2 --json $(RESULTS)/head_cuda.json \
		| tee $(RESULTS)/head_cuda.txt

# The headline: a Llama-3-8B shape, 8 x 2048 tokens, bf16, activation checkpointing, capped
# at 24 GiB (a 24 GiB GPU): with the fused head and embedding, then without them.
bench-gpu-24gib: $(GPU_STAMP)
	$(GPU_ENV) $(PY) -m bench.train --device cuda --model llama-3-8b \
		--dtype bf16 --seq 2048 --batch 8 --checkpointing --memory-cap-gib 24 --steps 3 \
		--warmup 1 --optimizers lomo,lomo_single,adalomo --fused-head --no-progress \
		--json $(RESULTS)/train_cuda_8b_24gib_fused.json \
		| tee $(RESULTS)/train_cuda_8b_24gib_fused.txt
	$(GPU_ENV) $(PY) -m bench.train --device cuda --model llama-3-8b \
		--dtype bf16 --seq 2048 --batch 8 --checkpointing --memory-cap-gib 24 --steps 3 \
		--warmup 1 --optimizers lomo,lomo_single,adalomo --no-progress \
		--json $(RESULTS)/train_cuda_8b_24gib.json | tee $(RESULTS)/train_cuda_8b_24gib.txt

# End to end: a 1B shape at seq 2048 (--batch: the largest AdamW fits), then a 7B shape with
# activation checkpointing; an optimizer that does not fit reports OOM.
bench-gpu-train-1b: $(GPU_STAMP)
	$(GPU_ENV) $(PY) -m bench.train --device cuda --model llama-1b \
		--dtype bf16 --seq 2048 --batch $(BENCH_1B_BATCH) --steps 10 --warmup 3 --no-progress \
		--optimizers adamw,lomo_optim,lomo,lomo_single,adalomo,adalomo_single,lomo_compiled_autograd \
		--json $(RESULTS)/train_cuda_1b.json --plot $(RESULTS)/train_cuda_1b.png \
		| tee $(RESULTS)/train_cuda_1b.txt

bench-gpu-train-7b: $(GPU_STAMP)
	$(GPU_ENV) $(PY) -m bench.train --device cuda --model llama-7b \
		--dtype bf16 --seq 2048 --batch $(BENCH_7B_BATCH) --checkpointing --steps 5 --warmup 2 \
		--optimizers adamw,lomo,lomo_single,adalomo,adalomo_single --no-progress \
		--json $(RESULTS)/train_cuda_7b.json --plot $(RESULTS)/train_cuda_7b.png \
		| tee $(RESULTS)/train_cuda_7b.txt

# ruff, and the documentation's strict build (a dead link or anchor, or a page missing from
# the nav, fails it).
lint: $(STAMP) docs
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site (README, BENCHMARKS and docs/) in site/, built in strict mode;
# mkdocs comes from the package's `docs` extra, installed into the venv on first use.
docs: $(STAMP)
	$(VENV)/bin/python -c "import mkdocs" 2>/dev/null || \
		$(VENV)/bin/python -m pip install -q --no-build-isolation -e ".[docs]"
	$(VENV)/bin/python -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info .pytest_cache site
