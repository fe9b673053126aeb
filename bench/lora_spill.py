#!/usr/bin/env python3
"""What a host-LRU miss of a LoRA adapter costs (a script, not a test): the worker's spill
file (conveyor.worker.lora.SpilledAdapters) against a read of the adapter's own directory.

The Llama-3.2-1B-shaped PEFT adapter of bench/lora_load.py (``--rank``), side by side,
``--repeats`` times, one torch thread: ``directory`` the full read and checks of the PEFT files
(what a miss cost when the directory was read again), ``spill write`` the copy written at the
adapter's first eviction, ``spill read`` a miss now. The spill read back is checked equal.

    python bench/lora_spill.py --rank 16
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
from lora_load import adapter_bench

from conveyor.worker.lora import SpilledAdapters, read_adapter


def main() -> None:
    with adapter_bench(__doc__, repeats=5) as (args, config, directory):
        spill = SpilledAdapters()
        times: dict[str, list[float]] = {"directory": [], "spill write": [], "spill read": []}
        for _ in range(args.repeats):
            start = time.perf_counter()
            adapter = read_adapter("x", directory, config, args.rank)
            times["directory"].append(time.perf_counter() - start)
            spill.forget("x")
            start = time.perf_counter()
            spill.write(adapter)
            times["spill write"].append(time.perf_counter() - start)
            start = time.perf_counter()
            back = spill.read("x")
            times["spill read"].append(time.perf_counter() - start)
        assert back.rank == adapter.rank and all(
            torch.equal(x, y) for m, pair in adapter.weights.items() for x, y in zip(pair, back.weights[m])
        )
        size = sum(f.stat().st_size for f in Path(spill._dir.name).iterdir())
    print(
        f"rank {args.rank}, spill file {size / 1e6:.1f} MB: "
        + ", ".join(
            f"{name} median {statistics.median(t) * 1e3:.0f} ms (min {min(t) * 1e3:.0f})" for name, t in times.items()
        )
    )


if __name__ == "__main__":
    main()
