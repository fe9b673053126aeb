#!/usr/bin/env python3
"""The sampler's cost per step with and without sampling controls (a script, not a test).

A greedy batch of ``--rows`` rows over a ``--vocab`` vocabulary is sampled through
:class:`~conveyor.worker.sampler.Sampler` as the runner does it (per-slot columns, the
controls' host selection and upload, the batched pass, the counts updated), with 0, half and
all of the rows using every control that costs a pass over its row (the three penalties and
a ``logit_bias``; each row's history 64 prompt + 128 output tokens). The three cases are
timed in turn, round after round, and the median of the rounds is printed.

    python bench/sampling_controls.py                      # vocab 32000 and 151936, 32 rows
    python bench/sampling_controls.py --vocab 4096 --rows 8 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from conveyor.ipc.messages import SamplingParams
from conveyor.worker.sampler import Sampler, SamplingColumns, batch_from_rows
from conveyor.worker.sampling_controls import SamplingControls

CONTROLLED = SamplingParams(
    temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logit_bias={10: 1.0, 20: -1.0}
)
PLAIN = SamplingParams(temperature=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10, help="steps timed per round and case")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = args.rows
    for vocab in args.vocab:
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
        sampler = Sampler("cpu", seed=0)
        cases = {}
        for controlled in (0, n // 2, n):
            columns, controls = SamplingColumns(), SamplingControls(vocab, "cpu", [2])
            for row in range(n):
                params = CONTROLLED if (row % 2 == 0 and row // 2 < controlled) or controlled == n else PLAIN
                columns.set(row, params)
                controls.assign(row, params, list(range(192)), 64)
            cases[controlled] = (columns, controls)
        slots, positions = np.arange(n), np.full(n, 192, np.int64)

        def step(columns: SamplingColumns, controls: SamplingControls) -> torch.Tensor:
            rows = controls.upload(controls.select(slots, positions))
            return sampler.sample(logits, batch_from_rows(columns.gather(slots), positions, vocab, "cpu", rows))

        times: dict[int, list[float]] = {k: [] for k in cases}
        for _ in range(args.rounds):
            for k, case in cases.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(*case)
                times[k].append((time.perf_counter() - start) / args.steps * 1e3)
        for k, values in times.items():
            print(
                f"vocab {vocab:6d}, {n} rows, {k:3d} controlled: {statistics.median(values):7.2f} ms per step (median)"
            )


if __name__ == "__main__":
    main()
