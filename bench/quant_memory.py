#!/usr/bin/env python3
"""Memory of a model loaded under each ``--quantization`` (a script, not a test).

Each scheme loads the checkpoint in a fresh process (``load_model`` on the CPU, as the worker
does) and reports the process's resident memory after the load (``VmRSS``; the worker's RSS
before its KV pool is allocated), its peak during the load (``VmHWM``), and the bytes of the
weights themselves (parameters and the quantized layers' tensors).

    python bench/quant_memory.py --model /path/SmolLM2-135M-Instruct.Q4_1.gguf --schemes none,int8,int4,auto
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, torch
torch.set_num_threads(1)
from conveyor.runtime.model_source import resolve_model
from conveyor.worker.loader import load_model
from conveyor.worker.models.layers import Linear
model, _ = load_model(resolve_model(sys.argv[1])[0], "cpu", "auto", quantization=sys.argv[2])
weights = sum(p.nbytes for p in model.parameters())
weights += sum(m.packed.nbytes for m in model.modules() if isinstance(m, Linear) and m.packed is not None)
quantized = [m.quant for m in model.modules() if isinstance(m, Linear) and m.quant is not None]
weights += sum(q.nbytes() for q in quantized)
if getattr(model, "tied_head_packed", None) is not None:
    weights += model.tied_head_packed.nbytes
status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
print(json.dumps({"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "peak_mib": int(status["VmHWM"].split()[0]) / 1024,
                  "weights_mib": weights / 2**20, "methods": sorted({type(q).__name__ for q in quantized})}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--schemes", default="none,int8,int4,auto")
    args = parser.parse_args()
    print(f"{'scheme':>8} {'RSS MiB':>9} {'peak MiB':>9} {'weights MiB':>12}  methods")
    for scheme in args.schemes.split(","):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, args.model, scheme], capture_output=True, text=True, check=True
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{scheme:>8} {row['rss_mib']:>9.0f} {row['peak_mib']:>9.0f} {row['weights_mib']:>12.0f}"
            f"  {','.join(row['methods'])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
