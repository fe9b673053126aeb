#!/usr/bin/env bash
# Everything issue 15 owes a GPU, in one call of at most 9 minutes (device tool: run this from
# the repo root): every GPU test, the kernel and decode-step benchmarks, bin/bench offline
# (fixed 128/128 and sharegpt; conveyor, hf, hf-cb, static) on the 1B-class bf16 Llama, and
# the worker's idle fraction with CUDA graphs at batch 1 and 128. Everything lands in one
# folder, ${OUT:-bench/out/gpu}, beside device.txt (GPU, driver, versions, commit) and a
# summary.json of the figures.
#
# The device image lacks pyzmq and msgspec: carry them as wheels in .whl/ (ignored by git),
# made here once with
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl pyzmq msgspec
# and run with carry [".whl"]; this script installs whatever .whl/ holds.
# Each stage has its own time limit (seconds below), so a slow one cannot take the others' time.
set -uo pipefail
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
START=$(date +%s)
stage() {  # stage NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s, at +$(( $(date +%s) - START ))s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc"; tail -n 3 "$OUT/$name.log"
}
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || pip install -q --no-deps -e . >/dev/null 2>&1
export PATH="$PWD/bin:$PATH"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    python3 -c "import zmq, msgspec; print('pyzmq', zmq.__version__, 'msgspec', msgspec.__version__)"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null) (plus the working tree)"
} 2>&1 | tee "$OUT/device.txt"

# 1. Tests: the kernels (compiled, not interpreted), and every test file with a test marked gpu.
GPU_FILES=$(grep -rl 'pytest.mark.gpu' tests --include='test_*.py' | grep -v '^tests/kernels/' | sort)
stage gpu_tests 200 python3 -m pytest -q -p no:cacheprovider tests/kernels $GPU_FILES

# 2. Kernels, and the decode step beside its roofline and HF (graphs on and off).
stage kernels 40 python3 bench/kernels.py --out "$OUT/kernels.json"
stage decode_step 80 python3 bench/decode_step.py --steps 10 --out "$OUT/decode_step.json"
# Host cost of one eager kernel call: our wrapper, then Triton's argument binding (launch stubbed).
stage launch_host 25 python3 bench/launch_host.py --label "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" --out "$OUT/launch_host.json"

# 3. End to end on the 1B-class model (random bf16 weights, the demo tokenizer).
python3 - <<'EOF'
import shutil, torch
from transformers import LlamaConfig, LlamaForCausalLM
from conveyor.checkpoints.demo import checkpoint as demo
cfg = LlamaConfig(vocab_size=4096, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained("/tmp/llama-1b")
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(demo.TOKENIZER_DIR / f, "/tmp/llama-1b")
EOF
COMMON=(--model /tmp/llama-1b --device cuda --dtype bfloat16 --kv-cache-memory 20 --no-progress)
stage offline_fixed 90 bin/bench offline "${COMMON[@]}" --workload fixed --prompt-len 128 --output-len 128 \
    --num-requests 256 --batch-size 128 --systems conveyor,hf,hf-cb,static --json "$OUT/offline_fixed.json"
stage offline_sharegpt 70 bin/bench offline "${COMMON[@]}" --workload sharegpt \
    --num-requests 256 --batch-size 128 --systems conveyor,hf,hf-cb,static --json "$OUT/offline_sharegpt.json"
# Worker idle fraction with graphs (the default on CUDA) at batch 1; batch 128 is offline_fixed's conveyor run.
stage idle_batch1 30 bin/bench offline "${COMMON[@]}" --workload fixed --prompt-len 128 --output-len 128 \
    --num-requests 4 --batch-size 1 --systems conveyor --json "$OUT/idle_batch1.json"
# Tensor parallelism (issue 19), only where two or more GPUs exist: TP=1 against TP=2 on the
# 1B model (the NCCL tests ran in gpu_tests above). The all-reduce share of a step needs a
# trace: nsys profile -t cuda,nvtx --trace-fork-before-exec=true, then nsys stats
# --report cuda_gpu_kern_sum (ncclDevKernel_AllReduce* over all kernel time).
if [ "$(nvidia-smi --list-gpus | wc -l)" -ge 2 ]; then
    for tp in 1 2; do
        stage "offline_tp$tp" 60 bin/bench offline "${COMMON[@]}" --workload fixed --prompt-len 128 --output-len 128 \
            --num-requests 256 --batch-size 128 --systems conveyor --serve-arg=--tensor-parallel-size \
            --serve-arg=$tp --json "$OUT/offline_tp$tp.json"
    done
fi

python3 - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    path = out / name
    return json.loads(path.read_text()) if path.exists() else None
summary = {}
step = load("decode_step.json")
if step:
    summary["decode_step"] = {
        f"{'graphs' if r['graphs'] else 'eager'} b={r['batch']} ctx={r['context']}":
        {k: r.get(k) for k in ("median_ms", "roofline_ms", "hf_ms", "kernel_launches_per_step")}
        for r in step["rows"]
    }
    summary["graph_startup"] = step.get("startup")
for name in ("offline_fixed", "offline_sharegpt", "idle_batch1", "offline_tp1", "offline_tp2"):
    result = load(f"{name}.json")
    if result is None:
        summary[name] = "missing (see its log)" if (out / f"{name}.log").exists() else "not run (needs two GPUs)"
        continue
    summary[name] = {
        system: v.get("unavailable") or {k: (v.get("median") or {}).get(k) for k in ("output_tok_s", "worker_idle_fraction")}
        for system, v in (result.get("systems") or {}).items()
    }
    summary[name + "_ratios"] = result.get("ratios")
print(json.dumps(summary, indent=1))
(out / "summary.json").write_text(json.dumps(summary, indent=1))
EOF
echo "done in $(( $(date +%s) - START ))s; results under $OUT"
