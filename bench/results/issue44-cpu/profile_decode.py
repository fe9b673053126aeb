"""The per-op profile of docs/benchmarks.md ("CPU on the real model"): torch.profiler over
decode steps at batch 1 and 8 (context 150) and a 256-token prefill of the in-process
ModelRunner.  python bench/results/issue44-cpu/profile_decode.py THREADS MODEL_DIR"""
import sys, time, statistics, torch
from pathlib import Path
REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO)); sys.path.insert(0, str(REPO / "src"))
from bench.decode_step import DecodeLoad, BLOCK_SIZE, GREEDY
from conveyor.runtime.config import RunnerConfig
from conveyor.worker.model_runner import ModelRunner
from conveyor.ipc.messages import CachedRequests, NewRequestData, StepPlan
from torch.profiler import profile, ProfilerActivity
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
MODEL_DIR = sys.argv[2] if len(sys.argv) > 2 else "/work/wt/_models/smollm2-hf"
torch.set_num_threads(threads)
ck = Path(MODEL_DIR)
runner = ModelRunner(RunnerConfig(ck, device="cpu", dtype=torch.float32, block_size=BLOCK_SIZE, num_blocks=2048, max_num_seqs=32))
sid = 0
for batch in (1, 8):
    load = DecodeLoad(runner, batch, 150, 60, sid)
    for _ in range(3): load.step()
    ts = []
    for _ in range(10):
        t = time.perf_counter(); load.step(); ts.append(time.perf_counter() - t)
    print(f"threads={threads} batch={batch} step median {1e3*statistics.median(ts):.1f} ms min {1e3*min(ts):.1f}")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5): load.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
    sid = load.close()
# prefill chunk of 256 tokens
tokens = [5 + i % 50 for i in range(256)]
def prefill(i):
    global sid
    sid += 1
    new = [NewRequestData(f"p{i}", 0, tokens, GREEDY, list(range(0, 17)), 0, 256)]
    runner.execute(StepPlan(sid, new, CachedRequests(), []))
    sid += 1
    runner.execute(StepPlan(sid, [], CachedRequests(), [0]))
prefill(0)
ts=[]
for i in range(3):
    t=time.perf_counter(); prefill(i+1); ts.append(time.perf_counter()-t)
print(f"prefill 256 median {1e3*statistics.median(ts):.1f} ms")
with profile(activities=[ProfilerActivity.CPU]) as prof:
    prefill(9)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
