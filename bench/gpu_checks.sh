#!/usr/bin/env bash
# Everything issue 4 owes a GPU, in one call (device tool: run this from the repo root).
# Writes logs and JSON under ${OUT:-bench/out}. Needs torch with CUDA, triton, transformers,
# safetensors, pytest and hypothesis (the device image has them).
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || pip install -q --no-deps -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
python -m pytest -q tests/kernels tests/worker/test_cuda_worker.py tests/e2e/test_scheduler_model.py 2>&1 | tee "$OUT/gpu_tests.log"
python bench/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
