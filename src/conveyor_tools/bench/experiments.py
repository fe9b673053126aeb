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

from conveyor_tools.bench.drivers import run_offline, run_online
from conveyor_tools.bench.metrics import OfflineRun, Timeline
from conveyor_tools.bench.server import BenchServer
from conveyor_tools.bench.workloads import Workload, make_workload, poisson_arrivals
from conveyor.client import AsyncClient

EXPERIMENTS = (1, 2, 3, 4, 5)
SYSTEMS = ("continuous", "static")  # continuous first: experiment 2's rate comes from its run
LATENCY_PERCENTILES = (50, 90, 95, 99)
SPREADS = {"low": 0.25, "medium": 0.75, "high": 1.5}  # lognormal sigma of output lengths
KV_POLL_S = 0.2  # the iteration log holds 256 rows: complete while a step takes > 0.8 ms
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.2  # bin/bench online's defaults (goodput is not a table here)
OFFLINE_GATE_WAIT_MS = 500.0

SOURCE_ANYSCALE = (
    'Anyscale, "How continuous batching enables 23x throughput in LLM inference while reducing p50 latency" (2023)'
)
SOURCE_ORCA = "Yu et al., Orca (OSDI 2022)"
PUBLISHED: dict[str, dict[str, Any]] = {
    "throughput": {"ratio": (5.95, 6.62), "setup": "LLaMA-7B, A100, ShareGPT", "sources": [SOURCE_ANYSCALE, SOURCE_ORCA]},
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


def kv_usage(rows: list[dict[str, Any]], start: float, end: float, block_size: int) -> dict[str, Any]:
    """KV blocks held over ``[start, end]`` (Unix seconds) from iteration-log rows.

    Each row's value holds from its time until the next row's (the last until ``end``), so
    the averages are over time. ``slack_tokens`` of a step is ``held_blocks x block_size -
    context_tokens``: KV slots held that hold no token of that step's context. That is the
    unfilled tail of each request's last block, plus the blocks of requests that finish with
    the step still in flight (the plan is formed before that step's result frees them: this
    makes the peaks), plus under static batching members waiting between prefill chunks.
    ``coverage`` is the fraction of the window's steps the poller saw."""
    inside = [r for r in rows if start <= r["time"] <= end]
    if not inside:
        return {"available": False, "reason": "no scheduler iteration inside the run's window"}
    t = np.array([r["time"] for r in inside], dtype=np.float64)
    held = np.array([r["held_blocks"] for r in inside], dtype=np.float64)
    slack = np.maximum(0.0, held * block_size - np.array([r["context_tokens"] for r in inside], dtype=np.float64))
    widths = np.diff(np.append(t, max(end, t[-1])))
    total = float(widths.sum())
    steps = [r["step"] for r in inside]

    def mean(x: np.ndarray) -> float:
        return float(np.dot(x, widths) / total) if total > 0 else float(x.mean())

    return {
        "available": True,
        "num_steps_seen": len(steps),
        "coverage": len(steps) / (steps[-1] - steps[0] + 1),
        "avg_held_blocks": mean(held),
        "peak_held_blocks": float(held.max()),
        "avg_slack_tokens": mean(slack),
        "peak_slack_tokens": float(slack.max()),
        "series": {"t_s": (t - start).tolist(), "held_blocks": held.tolist()},
    }


def padded_waste(workload: Workload, batch_size: int) -> dict[str, Any]:
    """The KV a padded static batch reserves and never fills, computed for ``workload``.

    Batches are consecutive groups of ``batch_size`` requests in submission order (static
    batching's FIFO batches when all arrive at once). A padded batch (HF ``generate``
    style) is a rectangle: every row left-padded to the batch's longest prompt and decoded
    for its longest output, so at its end it holds ``n x (max prompt + max output)`` token
    slots, of which ``sum(prompt + output)`` are real tokens. Waste of a batch = the
    difference; ``peak`` is the largest batch's (the memory the padding costs at once),
    ``total`` the sum over batches, ``fraction`` total waste / total slots."""
    reqs = workload.requests
    wastes, slots = [], []
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        rect = len(batch) * (max(r.prompt_len for r in batch) + max(r.output_len for r in batch))
        wastes.append(rect - sum(r.prompt_len + r.output_len for r in batch))
        slots.append(rect)
    return {
        "num_batches": len(wastes),
        "peak_waste_tokens": max(wastes),
        "total_waste_tokens": sum(wastes),
        "fraction": sum(wastes) / sum(slots),
    }


def occupancy(timeline: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Mean sequences per step, per step and over time (each step's batch holding until the
    next step starts), both also as a fraction of ``batch_size``."""
    if not timeline.get("t_s"):
        return {"available": False, "reason": timeline.get("source") or "no timeline"}
    per_step = Timeline(timeline["t_s"], timeline["running"]).mean()
    over_time = Timeline(timeline["t_s"], timeline["running"], step_function=True).mean()
    return {
        "available": True,
        "mean_per_step": per_step,
        "mean_over_time": over_time,
        "fraction_per_step": per_step / batch_size,
        "fraction_over_time": None if over_time is None else over_time / batch_size,
    }


def latency_percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in LATENCY_PERCENTILES}
    arr = np.percentile(np.asarray(values, dtype=np.float64), LATENCY_PERCENTILES)
    return {f"p{q}": float(v) for q, v in zip(LATENCY_PERCENTILES, arr)}


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
            jobs.append((_key(system, batch_size, "sharegpt"), lambda srv: self._offline(srv, system, batch_size, self.sharegpt(n))))
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
        self.setup.note(f"{system} @ {self.rate:.2f} req/s: e2e p50 {_f(e2e['p50'], 0, 2)} s, p99 {_f(e2e['p99'], 0, 2)} s, "
            f"{len(run.requests) - len(done)} failed")
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


def format_tables(tables: dict[str, Any], env: dict[str, Any], threads: int | None = None) -> str:
    """The five tables as text, each with the published figure beside ours, under the machine."""
    dev, host = env["device"], env["machine"]
    cpu = f"CPU {host['cpu']}, {host['usable_cpus']} usable cores" + (f", {threads} torch thread(s)" if threads else "")
    machine = cpu if dev["kind"] == "cpu" else f"{dev['name']} ({dev['kind']}); {cpu}"
    versions = env["versions"]
    out = [f"Machine: {machine}; torch {versions['torch']}, conveyor {versions['conveyor']}"]
    if "1_throughput" in tables:
        t = tables["1_throughput"]
        lo, hi = t["published"]["ratio"]
        lines = [
            f"1. Throughput, continuous vs static (output tok/s; published {lo}x to {hi}x on {t['published']['setup']})",
            f"{'batch':>6} {'requests':>9} {'continuous':>11} {'static':>9} {'ratio':>7}",
        ]
        for r in t["rows"]:
            lines.append(
                f"{r['batch_size']:>6} {r['num_requests']:>9} {_f(r['continuous_tok_s'], 11, 1)} "
                f"{_f(r['static_tok_s'], 9, 1)} {_f(r['ratio'], 6, 2)}x" + _na(r["unavailable"])
            )
        out.append("\n".join(lines))
    if "2_latency" in tables:
        t = tables["2_latency"]
        lo, hi = t["published"]["ratio"]
        rate = "-" if t["rate_req_s"] is None else f"{t['rate_req_s']:.2f}"
        how = "" if t["load"] is None else f" ({t['load']:.0%} of continuous capacity)"
        lines = [
            f"2. End-to-end latency at {rate} req/s{how}, batch {t['batch_size']} "
            f"(static / continuous; published {lo}x to {hi}x lower)" + _na(t["unavailable"]),
            f"{'pct':>5} {'continuous s':>13} {'static s':>9} {'ratio':>7}",
        ]
        for r in t["rows"]:
            lines.append(f"{'p' + str(r['percentile']):>5} {_f(r['continuous_s'], 13, 2)} {_f(r['static_s'], 9, 2)} {_f(r['ratio'], 6, 2)}x")
        out.append("\n".join(lines))
    if "3_occupancy" in tables:
        t = tables["3_occupancy"]
        p = t["published"]
        lines = [
            f"3. Batch occupancy, batch {t['batch_size']} (mean sequences per step / max_num_seqs; "
            f"published static {p['static']:.0%}, continuous {p['continuous']:.0%})",
            f"{'system':<11} {'per step':>9} {'over time':>10} {'seqs/step':>10}",
        ]
        lines += _system_rows(
            t,
            11,
            lambda o: f"{_pct(o['fraction_per_step'], 9)} {_pct(o['fraction_over_time'], 10)} {_f(o['mean_per_step'], 10, 1)}",
        )
        out.append("\n".join(lines))
    if "4_kv" in tables:
        t = tables["4_kv"]
        p = t["published"]
        per_token = t["kv_bytes_per_token"]
        lines = [
            f"4. KV cache, batch {t['batch_size']} (blocks of {t['block_size']} tokens, {per_token} bytes of KV per token; "
            f"published waste: static {p['static_gb']:g} GB, continuous {p['continuous_gb']:g} GB)",
            f"{'system':<15} {'avg blocks':>10} {'peak blocks':>11} {'avg slack tok':>13} {'peak waste':>11} {'coverage':>9}",
        ]
        lines += _system_rows(
            t,
            15,
            lambda kv: f"{_f(kv['avg_held_blocks'], 10, 1)} {_f(kv['peak_held_blocks'], 11, 0)} "
            f"{_f(kv['avg_slack_tokens'], 13, 1)} {_bytes(kv['peak_slack_tokens'] * per_token, 11)} {_pct(kv['coverage'], 9)}",
        )
        pad = t["padded_static"]
        lines.append(
            f"{'padded static':<15} {'(computed)':>10} {'':>11} {'':>13} {_bytes(pad['peak_waste_tokens'] * per_token, 11)} "
            f"  {pad['fraction']:.0%} of padded slots never hold a token"
        )
        out.append("\n".join(lines))
    if "5_variance" in tables:
        t = tables["5_variance"]
        lines = [
            f"5. Output-length spread at one mean, batch {t['batch_size']} (continuous / static throughput)",
            f"{'spread':<7} {'sigma':>6} {'cv':>5} {'continuous':>11} {'static':>9} {'ratio':>7} {'published':>10}",
        ]
        for r in t["rows"]:
            lines.append(
                f"{r['spread']:<7} {r['sigma']:>6.2f} {_f(r['output_len_cv'], 5, 2)} {_f(r['continuous_tok_s'], 11, 1)} "
                f"{_f(r['static_tok_s'], 9, 1)} {_f(r['ratio'], 6, 2)}x {r['published']:>9.1f}x" + _na(r["unavailable"])
            )
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _f(value: float | None, width: int, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{value:>{width}.{digits}f}"


def _system_rows(table: dict[str, Any], width: int, row: Callable[[dict[str, Any]], str]) -> list[str]:
    """One line per system: its name, then ``row`` of its entry, or n/a and why it did not run."""
    return [
        f"{s:<{width}} {row(table[s])}" if table[s].get("available") else f"{s:<{width}} n/a: {table[s].get('reason')}"
        for s in SYSTEMS
    ]


def _pct(value: float | None, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.0%}"


def _bytes(value: float, width: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:>{width - 4}.2f} {unit}"
    return f"{value:>{width - 2}.0f} B"


def _na(reason: str | None) -> str:
    return f"  n/a: {reason}" if reason else ""


def sizes_json(sizes: Sizes) -> dict[str, Any]:
    return {**asdict(sizes), "spreads": SPREADS}
