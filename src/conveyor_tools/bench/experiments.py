"""bin/bench experiments: the tables of the classic continuous-batching write-ups, rerun here.

Five experiments compare Conveyor's continuous batching (``continuous``: bin/serve) with its
static batching (``static``: bin/serve --batching static, the fair baseline: a batch of up to
``max_num_seqs`` requests, prefilled over as many steps as the token budget needs, decoded
until its last member finishes) on the same model, device and requests:

1. output throughput over batch sizes (offline, ShareGPT-shaped lengths);
2. end-to-end latency percentiles at one fixed Poisson arrival rate;
3. batch occupancy over time and its average as a fraction of ``max_num_seqs``;
4. KV-cache blocks held (average, peak) and the padding a padded static batch would waste;
5. throughput over output-length spread at one mean (lognormal outputs, three sigmas).

There is no harness of its own: every run is a :class:`~conveyor_tools.bench.server.BenchServer`
driven by :func:`~conveyor_tools.bench.drivers.run_offline` or
:func:`~conveyor_tools.bench.drivers.run_online`, on workloads from
:mod:`~conveyor_tools.bench.workloads`. One server per (system, batch size) serves every
offline run of that pair, another its online run (:func:`offline_gate` says why). The one
thing added is a poller of the scheduler's iteration log (``stats`` with ``iterations``, at
most 256 rows) during offline runs: it keeps every iteration's ``held_blocks`` and
``context_tokens`` (steps seen / steps run is recorded as ``coverage``), which is where the
KV table comes from.

The published figures (:data:`PUBLISHED`) are the ones issue 16 quotes from the Anyscale
post "How continuous batching enables 23x throughput in LLM inference while reducing p50
latency" (2023) and the Orca paper (OSDI 2022); they were measured on other models and
GPUs, so they are shown beside ours for the direction and rough size of each effect, not as
numbers to match. docs/experiments.md has the method, definitions and results.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from conveyor.client import AsyncClient
from conveyor_tools.bench.batch_stats import LATENCY_PERCENTILES, kv_usage, latency_percentiles, occupancy, padded_waste
from conveyor_tools.bench.drivers import run_offline, run_online
from conveyor_tools.bench.run_metrics import OfflineRun
from conveyor_tools.bench.server import BenchServer
from conveyor_tools.bench.workloads import Workload, make_workload, poisson_arrivals

EXPERIMENTS = (1, 2, 3, 4, 5)
SYSTEMS = ("continuous", "static")  # continuous first: experiment 2's rate comes from its run
SPREADS = {"low": 0.25, "medium": 0.75, "high": 1.5}  # lognormal sigma of output lengths
KV_POLL_S = 0.2  # the iteration log holds 256 rows: complete while a step takes > 0.8 ms
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.2  # bin/bench online's defaults (goodput is not a table here)
OFFLINE_GATE_WAIT_MS = 500.0

SOURCE_ANYSCALE = (
    'Anyscale, "How continuous batching enables 23x throughput in LLM inference while reducing p50 latency" (2023)'
)
SOURCE_ORCA = "Yu et al., Orca (OSDI 2022)"
PUBLISHED: dict[str, dict[str, Any]] = {
    "throughput": {
        "ratio": (5.95, 6.62),
        "setup": "LLaMA-7B, A100, ShareGPT",
        "sources": [SOURCE_ANYSCALE, SOURCE_ORCA],
    },
    "latency": {"ratio": (4.1, 4.4), "sources": [SOURCE_ANYSCALE, SOURCE_ORCA]},
    "occupancy": {"static": 0.42, "continuous": 0.94, "sources": [SOURCE_ANYSCALE, SOURCE_ORCA]},
    "kv_waste": {"static_gb": 16.0, "continuous_gb": 0.5, "sources": [SOURCE_ANYSCALE, SOURCE_ORCA]},
    "variance": {"low": 1.2, "medium": 3.5, "high": 8.2, "sources": [SOURCE_ANYSCALE, SOURCE_ORCA]},
}


@dataclass(frozen=True)
class Sizes:
    """How big each experiment is. ``FULL`` fits about 15 minutes of the demo model on 2 CPU
    cores; ``QUICK`` is the CI smoke run on a tiny checkpoint."""

    batch_sizes: tuple[int, ...]  # experiment 1's sweep
    batches_per_run: int  # experiment 1: requests = batches_per_run x batch size
    focus_batch: int  # the batch size of experiments 2 to 5
    sharegpt_scale: float  # ShareGPT means (161 / 338 tokens) and clip, times this
    online_requests: int  # experiment 2
    load: float  # experiment 2's rate: this fraction of continuous capacity at focus_batch
    spread_requests: int  # experiment 5, per spread
    spread_prompt_len: int
    spread_mean_output: int


FULL = Sizes((8, 16, 32, 64, 128), 6, 32, 0.5, 160, 0.7, 512, 32, 96)
QUICK = Sizes((2, 4), 2, 4, 0.05, 8, 0.7, 8, 8, 8)


@dataclass(frozen=True)
class Setup:
    """What every run shares. ``serve_args(system, batch_size)`` gives bin/serve's flags."""

    serve_args: Callable[[str, int], list[str]]
    progress: Callable[[int, str], Any]  # (total, label) -> a tqdm-like context manager
    vocab_size: int
    max_model_len: int
    seed: int
    timeout: float
    block_size: int
    kv_bytes_per_token: int  # 2 (K and V) x layers x KV heads x head dim x dtype bytes
    rate: float | None = None  # experiment 2's rate; None: Sizes.load x measured capacity
    note: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)  # a line per run


# ---------------------------------------------------------------- measuring


def offline_gate(system: str, batch_size: int) -> list[str]:
    """Extra bin/serve flags of a server that runs offline jobs: for ``static``, admit nobody
    until ``batch_size`` requests wait or the oldest has waited 0.5 s; none for ``continuous``.

    An offline run submits every request at t = 0, but they reach the scheduler one by one
    over some milliseconds; without this gate static batching forms its first batch from
    whatever has arrived when it first plans (one request in the CPU runs, which then spent
    up to 12 % of their time decoding a batch of one). With it its first batch is full, and
    later batches never wait: the queue holds a batch's worth, or its oldest has waited since
    t = 0 (runs are ``batches x batch size`` requests; a last partial batch waits at most until
    0.5 s after the start). Continuous batching admits at every step, so late arrivals cost
    it nothing and the gate could only delay it. Online runs get servers without it: the
    arrivals are the experiment there."""
    if system != "static":
        return []
    return ["--min-batch-size", str(batch_size), "--max-wait-ms", f"{OFFLINE_GATE_WAIT_MS:g}"]


class _Stamped:
    """A progress bar proxy that notes when it was last advanced (Unix seconds): the offline
    driver advances it as each request completes, so the last stamp is the run's end."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.last = time.time()

    def update(self, n: int = 1) -> None:
        self.last = time.time()
        self.bar.update(n)


async def _offline_with_kv(
    system: str, address: str, workload: Workload, progress: Any, timeout: float
) -> tuple[OfflineRun, list[dict[str, Any]], float, float]:
    """:func:`run_offline`, with the scheduler's iteration log polled beside it.
    Returns the run, every iteration row seen (by step, oldest first) and the run's window
    in Unix seconds, the server's clock too (same host): it ends when the last request
    completed and starts the run's wall time before."""
    rows: dict[int, dict[str, Any]] = {}
    done = asyncio.Event()
    stamped = _Stamped(progress)

    async def poll() -> None:
        async with AsyncClient(address, timeout=timeout) as client:
            while True:
                for row in (await client.stats(iterations=True)).get("iterations", []):
                    rows[row["step"]] = row
                if done.is_set():
                    return
                try:
                    await asyncio.wait_for(done.wait(), KV_POLL_S)
                except asyncio.TimeoutError:
                    pass

    poller = asyncio.create_task(poll())
    try:
        run = await run_offline(system, address, workload, stamped, timeout)
    finally:
        done.set()
        await poller
    end = stamped.last
    return run, [rows[k] for k in sorted(rows)], end - run.wall_s, end


# ---------------------------------------------------------------- running


Job = Callable[[BenchServer], dict[str, Any]]


class Experiments:
    """Runs the experiments in ``only`` with ``sizes``; :meth:`run` returns the JSON payload's
    ``experiments`` part: ``runs`` (every raw run, keyed) and ``tables`` (the five)."""

    def __init__(self, setup: Setup, sizes: Sizes, only: set[int]) -> None:
        self.setup = setup
        self.sizes = sizes
        self.only = only
        self.runs: dict[str, dict[str, Any]] = {}
        self.failed: dict[str, str] = {}  # system -> first failure
        self.rate: float | None = setup.rate

    # ---- workloads: one seed, so every system gets exactly the same requests

    def sharegpt(self, num_requests: int) -> Workload:
        s = self.setup
        return make_workload(
            "sharegpt", num_requests, seed=s.seed, vocab_size=s.vocab_size, max_model_len=s.max_model_len,
            scale=self.sizes.sharegpt_scale,
        )  # fmt: skip

    def spread(self, sigma: float) -> Workload:
        """Experiment 5's set at ``sigma``: a seed of its own per spread, since with one seed
        the three sets would share their prompts, and a server's prefix cache would serve the
        later sets' prompts from the earlier ones."""
        s, z = self.setup, self.sizes
        seed = s.seed + 1 + sorted(SPREADS.values()).index(sigma)
        return make_workload(
            "lognormal", z.spread_requests, seed=seed, vocab_size=s.vocab_size, max_model_len=s.max_model_len,
            prompt_len=z.spread_prompt_len, output_len=z.spread_mean_output, output_sigma=sigma,
        )  # fmt: skip

    def throughput_requests(self, batch_size: int) -> int:
        return self.sizes.batches_per_run * batch_size

    # ---- the schedule of servers and runs

    def batch_sizes(self) -> list[int]:
        sizes = set(self.sizes.batch_sizes) if 1 in self.only else set()
        if self.only & {2, 3, 4, 5}:
            sizes.add(self.sizes.focus_batch)
        return sorted(sizes)

    def run(self) -> dict[str, Any]:
        for batch_size in self.batch_sizes():
            for system in SYSTEMS:
                for gated in (True, False):
                    jobs = self._jobs(system, batch_size, offline=gated)
                    if jobs and system not in self.failed:
                        self._serve(system, batch_size, gated, jobs)
        return {"runs": self.runs, "tables": self.tables()}

    def _serve(self, system: str, batch_size: int, gated: bool, jobs: list[tuple[str, Job]]) -> None:
        """One server for ``jobs``; a failure marks the system failed, with its reason on
        every run it leaves undone."""
        args = self.setup.serve_args(system, batch_size) + (offline_gate(system, batch_size) if gated else [])
        try:
            with BenchServer(args) as server:
                for key, job in jobs:
                    self.runs[key] = job(server)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # reported with the reason, never a number
            reason = f"{type(exc).__name__}: {exc}".strip()
            self.failed[system] = reason.splitlines()[0][:300]
            self.setup.note(f"{system} could not run: {reason}")
            for key, _ in jobs:
                self.runs.setdefault(key, {"unavailable": self.failed[system], "detail": reason[:4000]})

    def _jobs(self, system: str, batch_size: int, *, offline: bool) -> list[tuple[str, Job]]:
        focus = batch_size == self.sizes.focus_batch
        jobs: list[tuple[str, Job]] = []
        if not offline:
            if focus and 2 in self.only:
                jobs.append((_key(system, batch_size, "online"), lambda srv: self._online(srv, system)))
            return jobs
        if 1 in self.only or focus:
            n = self.throughput_requests(batch_size)
            jobs.append(
                (
                    _key(system, batch_size, "sharegpt"),
                    lambda srv: self._offline(srv, system, batch_size, self.sharegpt(n)),
                )
            )
        if focus and 5 in self.only:
            for level, sigma in SPREADS.items():
                jobs.append(
                    (_key(system, batch_size, f"spread-{level}"),
                     lambda srv, sigma=sigma: self._offline(srv, system, batch_size, self.spread(sigma)))
                )  # fmt: skip
        return jobs

    def _offline(self, server: BenchServer, system: str, batch_size: int, workload: Workload) -> dict[str, Any]:
        label = f"{system} b={batch_size} {workload.name}"
        if workload.name == "lognormal":
            label += f" sigma={workload.params['output_sigma']:g}"
        with self.setup.progress(len(workload.requests), label) as bar:
            run, rows, start, end = asyncio.run(
                _offline_with_kv(system, server.address, workload, bar, self.setup.timeout)
            )
        outputs = np.array([r.output_len for r in workload.requests], dtype=np.float64)
        record = {
            "system": system,
            "batch_size": batch_size,
            "workload": workload.describe(),
            "output_len_cv": float(outputs.std() / outputs.mean()),
            "summary": run.summary(),
            "latencies_s": run.latencies_s,
            "timeline": run.timeline.to_json(),
            "occupancy": occupancy(run.timeline.to_json(), batch_size),
            "kv": kv_usage(rows, start, end, self.setup.block_size),
        }
        occ = record["occupancy"].get("fraction_over_time")
        self.setup.note(
            f"{label}: {run.summary()['output_tok_s']:.1f} out tok/s over {run.wall_s:.1f} s"
            + ("" if occ is None else f", occupancy {occ:.0%}")
        )
        if system == "continuous" and batch_size == self.sizes.focus_batch and workload.name == "sharegpt":
            if self.rate is None:
                self.rate = self.sizes.load * record["summary"]["req_s"]
        return record

    def _online(self, server: BenchServer, system: str) -> dict[str, Any]:
        if self.rate is None:
            raise RuntimeError("no arrival rate: the continuous capacity run did not complete")
        workload = self.sharegpt(self.sizes.online_requests)
        arrivals = poisson_arrivals(len(workload.requests), self.rate, self.setup.seed)
        with self.setup.progress(len(workload.requests), f"{system} @ {self.rate:.2f} req/s") as bar:
            run = asyncio.run(
                run_online(
                    system, server.address, workload, arrivals, self.rate, SLO_TTFT_S, SLO_TPOT_S, bar,
                    self.setup.timeout,
                )
            )  # fmt: skip
        done = [r for r in run.requests if r.ok]
        e2e = latency_percentiles([r.e2e for r in done])
        self.setup.note(
            f"{system} @ {self.rate:.2f} req/s: e2e p50 {number_text(e2e['p50'], 0, 2)} s, p99 "
            f"{number_text(e2e['p99'], 0, 2)} s, "
            f"{len(run.requests) - len(done)} failed"
        )
        return {
            "system": system,
            "rate": self.rate,
            "workload": workload.describe(),
            "summary": run.summary(),
            "e2e_s": e2e,
            "ttft_s": latency_percentiles([r.ttft for r in done if r.ttft is not None]),
            "raw": {"e2e_s": [r.e2e for r in done], "ttft_s": [r.ttft for r in done if r.ttft is not None]},
        }

    # ---- the tables (the numbers only; format_tables renders them)

    def tables(self) -> dict[str, Any]:
        focus = self.sizes.focus_batch
        out: dict[str, Any] = {}
        if 1 in self.only:
            rows = []
            for b in self.sizes.batch_sizes:
                cont, stat = (self.runs.get(_key(s, b, "sharegpt"), {}) for s in SYSTEMS)
                rows.append(
                    {
                        "batch_size": b,
                        "num_requests": self.throughput_requests(b),
                        "continuous_tok_s": _get(cont, "summary", "output_tok_s"),
                        "static_tok_s": _get(stat, "summary", "output_tok_s"),
                        "ratio": _ratio(_get(cont, "summary", "output_tok_s"), _get(stat, "summary", "output_tok_s")),
                        "unavailable": _why(cont, stat),
                    }
                )
            out["1_throughput"] = {"rows": rows, "published": PUBLISHED["throughput"]}
        if 2 in self.only:
            cont, stat = (self.runs.get(_key(s, focus, "online"), {}) for s in SYSTEMS)
            rows = []
            for q in LATENCY_PERCENTILES:
                c, s = _get(cont, "e2e_s", f"p{q}"), _get(stat, "e2e_s", f"p{q}")
                rows.append({"percentile": q, "continuous_s": c, "static_s": s, "ratio": _ratio(s, c)})
            out["2_latency"] = {
                "batch_size": focus,
                "rate_req_s": self.rate,
                "load": None if self.setup.rate is not None else self.sizes.load,
                "rows": rows,
                "unavailable": _why(cont, stat),
                "published": PUBLISHED["latency"],
            }
        if 3 in self.only:
            table = {"batch_size": focus, "published": PUBLISHED["occupancy"]}
            for s in SYSTEMS:
                run = self.runs.get(_key(s, focus, "sharegpt"), {})
                table[s] = run.get("occupancy") or {"available": False, "reason": run.get("unavailable", "not run")}
            out["3_occupancy"] = table
        if 4 in self.only:
            table = {
                "batch_size": focus,
                "block_size": self.setup.block_size,
                "kv_bytes_per_token": self.setup.kv_bytes_per_token,
                "padded_static": padded_waste(self.sharegpt(self.throughput_requests(focus)), focus),
                "published": PUBLISHED["kv_waste"],
            }
            for s in SYSTEMS:
                run = self.runs.get(_key(s, focus, "sharegpt"), {})
                kv = dict(run.get("kv") or {"available": False, "reason": run.get("unavailable", "not run")})
                kv.pop("series", None)
                table[s] = kv
            out["4_kv"] = table
        if 5 in self.only:
            rows = []
            for level, sigma in SPREADS.items():
                cont, stat = (self.runs.get(_key(s, focus, f"spread-{level}"), {}) for s in SYSTEMS)
                rows.append(
                    {
                        "spread": level,
                        "sigma": sigma,
                        "output_len_cv": cont.get("output_len_cv", stat.get("output_len_cv")),
                        "mean_output": self.sizes.spread_mean_output,
                        "continuous_tok_s": _get(cont, "summary", "output_tok_s"),
                        "static_tok_s": _get(stat, "summary", "output_tok_s"),
                        "ratio": _ratio(_get(cont, "summary", "output_tok_s"), _get(stat, "summary", "output_tok_s")),
                        "published": PUBLISHED["variance"][level],
                        "unavailable": _why(cont, stat),
                    }
                )
            out["5_variance"] = {"batch_size": focus, "rows": rows, "published": PUBLISHED["variance"]}
        return out


def _key(system: str, batch_size: int, workload: str) -> str:
    return f"{system}/b{batch_size}/{workload}"


def _get(record: dict[str, Any], *path: str) -> Any:
    for part in path:
        if not isinstance(record, dict):
            return None
        record = record.get(part)
    return record


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _why(*records: dict[str, Any]) -> str | None:
    reasons = [r["unavailable"] for r in records if "unavailable" in r]
    return "; ".join(reasons) or None


# ---------------------------------------------------------------- text


def number_text(value: float | None, width: int, digits: int) -> str:
    """``value`` right-aligned in ``width`` with ``digits`` decimals; ``-`` for none (None, NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{value:>{width}.{digits}f}"


def sizes_json(sizes: Sizes) -> dict[str, Any]:
    return {**asdict(sizes), "spreads": SPREADS}
