"""Smoke runs of the measuring tools as a user runs them: bin/bench and bin/profile.

Real benchmark runs are not tests (docs/benchmarks.md); these prove the commands work end to
end on a tiny checkpoint and that their output has the promised shape with sane numbers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

from conveyor.client import Client
from tests.e2e.serve_harness import REPO

SERVE_ARGS = ("--num-kv-blocks", "64", "--block-size", "8", "--threads", "1", "--max-num-batched-tokens", "128")
STAGES = {
    "frontend": {
        "tokenize",
        "detokenize",
        "client_send",
        "event_loop_lag",
        "handle_outputs",
        "request_ttft",
        "request_itl",
    },
    "scheduler": {"schedule", "update", "plan_round_trip", "transport_overhead", "batch_seqs"},
    "worker": {"idle", "execute", "prepare_inputs", "forward", "sample"},
}


def run_tool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"{args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_bench_offline_all_systems(tiny_checkpoint, tmp_path) -> None:
    out = tmp_path / "offline.json"
    args = [
        str(REPO / "bin" / "bench"), "offline", "--model", str(tiny_checkpoint),
        "--systems", "conveyor,static,hf,hf-cb", "--workload", "high-variance", "--num-requests", "6",
        "--batch-size", "3", "--kv-cache-memory", "0.01", "--threads", "1", "--max-model-len", "256",
        "--no-progress", "--json", str(out),
    ]  # fmt: skip
    plots = importlib.util.find_spec("matplotlib") is not None
    if plots:
        args += ["--plot", str(tmp_path / "plots")]
    proc = run_tool(*args, timeout=180)
    result = json.loads(out.read_text())
    assert result["benchmark"] == "offline" and result["workload"]["num_requests"] == 6
    assert result["environment"]["versions"]["torch"] and "git" in result["environment"]
    systems = result["systems"]
    assert set(systems) == {"conveyor", "static", "hf", "hf-cb"}
    for name in ("conveyor", "static", "hf"):
        assert "unavailable" not in systems[name], systems[name]
    for name, system in systems.items():
        if "unavailable" in system:  # hf-cb may refuse a platform: then it says why, with no number
            assert name == "hf-cb" and system["unavailable"]
            continue
        summary = system["runs"][0]
        assert summary["output_tokens"] == result["workload"]["output_tokens"]
        for key in ("output_tok_s", "total_tok_s", "req_s", "wall_s"):
            assert summary[key] > 0, (name, key, summary)
        assert len(system["latencies_s"]) == 6 and all(x > 0 for x in system["latencies_s"])
        assert system["timeline"]["t_s"] and max(system["timeline"]["running"]) <= 3
        assert result["ratios"][name]["throughput_vs_conveyor"] > 0
    assert result["ratios"]["conveyor"]["throughput_vs_conveyor"] == 1.0
    # The server's own profile came back with the run.
    assert systems["conveyor"]["extra"]["server_profile"]["worker"]["metrics"]["forward"]["count"] > 0
    assert "conveyor speedup" in proc.stdout and "hf-cb" in proc.stdout
    # transformers' own weight-loading bar and psutil notices stay out of the benchmark's output.
    assert "Loading weights" not in proc.stderr and "psutil" not in proc.stderr, proc.stderr
    if plots:
        for name in ("throughput.png", "latency_cdf.png", "batch_occupancy.png"):
            assert (tmp_path / "plots" / name).stat().st_size > 1000


def test_profile_and_online_bench_against_a_running_server(serve_factory, tiny_checkpoint, tmp_path) -> None:
    server = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS)
    with Client(server.address, timeout=60) as client:
        for i in range(4):
            result = client.generate(token_ids=[10 + i, 11, 12], max_tokens=6, temperature=0, ignore_eos=True)
            assert result.finish_reason == "length"
        reply = client.profile(30.0, series=["batch_seqs"])
    assert reply["type"] == "profile" and reply["error"] is None and reply["clock"] == "CLOCK_MONOTONIC"
    by_name = {p["process"]: p for p in reply["processes"]}
    assert set(by_name) == {"frontend", "scheduler", "worker"}
    for process, stages in STAGES.items():
        proc = by_name[process]
        assert proc["enabled"] and proc["pid"] == server.pids[process]
        missing = stages - set(proc["metrics"])
        assert not missing, (process, missing)
        for stage in stages:
            m = proc["metrics"][stage]
            assert m["count"] > 0 and m["p50"] >= 0 and m["p99"] >= m["p50"] and m["max"] >= m["p99"], (stage, m)
    assert 0.0 <= by_name["worker"]["values"]["idle_fraction"] <= 1.0
    assert by_name["frontend"]["counters"]["output_tokens"]["total"] == 24
    assert by_name["scheduler"]["series"]["batch_seqs"]["values"]

    trace_path, json_path = tmp_path / "trace.json", tmp_path / "profile.json"
    proc = run_tool(
        str(REPO / "bin" / "profile"), "--host", server.address, "--window", "30",
        "--trace", str(trace_path), "--json", str(json_path),
    )  # fmt: skip
    for process in STAGES:
        assert f"{process} (pid {server.pids[process]}" in proc.stdout
    assert "p99" in proc.stdout and "idle_fraction" in proc.stdout
    events = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == set(server.pids.values())
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    steps = {e["args"]["step"] for e in spans if e["name"] == "execute"}
    assert steps and steps <= {e["args"]["step"] for e in spans if e["name"] == "plan_round_trip"}
    assert any(e["ph"] == "s" for e in events) and any(e["ph"] == "f" for e in events)
    assert json.loads(json_path.read_text())["processes"]

    out = tmp_path / "online.json"
    run_tool(
        str(REPO / "bin" / "bench"), "online", "--address", server.address, "--model", str(tiny_checkpoint),
        "--workload", "fixed", "--prompt-len", "8", "--output-len", "6", "--num-requests", "5", "--rate", "20,inf",
        "--no-progress", "--json", str(out),
    )  # fmt: skip
    online = json.loads(out.read_text())
    assert [r["summary"]["rate"] for r in online["runs"]] == [20.0, "inf"]
    for run in online["runs"]:
        s = run["summary"]
        assert s["num_failed"] == 0 and s["output_tokens"] == 30
        assert s["ttft_s"]["p50"] > 0 and s["tpot_s"]["p50"] > 0 and s["e2e_s"]["p99"] >= s["e2e_s"]["p50"] > 0
        assert s["itl_s"]["p50"] > 0 and s["goodput_req_s"] >= 0 and s["output_tok_s"] > 0


def test_no_profile_switches_every_process_off(serve_factory, tiny_checkpoint) -> None:
    server = serve_factory("--model", str(tiny_checkpoint), *SERVE_ARGS, "--no-profile")
    with Client(server.address, timeout=60) as client:
        assert client.generate(token_ids=[10, 11], max_tokens=3, ignore_eos=True).finish_reason == "length"
        reply = client.profile(10.0, trace=True)
    assert [p["process"] for p in reply["processes"]] == ["frontend", "scheduler", "worker"]
    for proc in reply["processes"]:
        assert not proc["enabled"] and proc["metrics"] == {} and proc["trace"] is None


def test_bench_online_http_gives_a_row_beside_zeromq(tiny_checkpoint, tmp_path) -> None:
    """--http: the same load through the OpenAI API (conveyor-http) beside ZeroMQ, with the ratio."""
    out = tmp_path / "online-http.json"
    proc = run_tool(
        str(REPO / "bin" / "bench"), "online", "--model", str(tiny_checkpoint), "--http",
        "--workload", "fixed", "--prompt-len", "8", "--output-len", "6", "--num-requests", "5", "--rate", "inf",
        "--batch-size", "4", "--kv-cache-memory", "0.01", "--threads", "1", "--max-model-len", "256",
        "--no-progress", "--json", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["settings"]["systems"] == ["conveyor", "conveyor-http"]
    runs = {run["system"]: run for run in result["runs"]}
    assert set(runs) == {"conveyor", "conveyor-http"}
    for name, run in runs.items():
        s = run["summary"]
        assert s["num_failed"] == 0 and s["output_tokens"] == 30, (name, s)
        assert s["ttft_s"]["p50"] > 0 and s["tpot_s"]["p50"] > 0 and s["e2e_s"]["p99"] >= s["e2e_s"]["p50"] > 0
        assert s["itl_s"]["p50"] > 0 and s["output_tok_s"] > 0
        assert run["extra"]["server_profile"]["frontend"]["counters"]["output_tokens"]["total"] > 0
        assert {"load_generator", "frontend", "scheduler", "worker"} <= set(run["extra"]["cpu_s"])
    http = runs["conveyor-http"]
    assert http["extra"]["base_url"].startswith("http://127.0.0.1:") and "http" in http["extra"]["cpu_s"]
    assert 0 < http["extra"]["content_events_per_token"] <= 1
    assert result["ratios"]["conveyor"]["inf"]["throughput_vs_conveyor"] == 1.0
    assert result["ratios"]["conveyor-http"]["inf"]["throughput_vs_conveyor"] > 0
    assert "conveyor-http" in proc.stdout and "x conveyor" in proc.stdout and "CPU us/token" in proc.stdout


def test_bench_offline_serves_a_mixture_of_experts_beside_hf(tmp_path) -> None:
    """bin/bench on a tiny Qwen3-MoE (tests/checkpoints.py), Conveyor beside HF padded and HF
    continuous batching in the same run, every system producing the workload's tokens."""
    from tests.checkpoints import moe_serving_checkpoint

    (tmp_path / "moe").mkdir()
    model = moe_serving_checkpoint(tmp_path / "moe", "qwen3_moe")
    out = tmp_path / "moe.json"
    run_tool(
        str(REPO / "bin" / "bench"), "offline", "--model", str(model), "--systems", "conveyor,hf,hf-cb",
        "--workload", "fixed", "--prompt-len", "12", "--output-len", "6", "--num-requests", "4", "--batch-size", "2",
        "--kv-cache-memory", "0.01", "--threads", "1", "--no-progress", "--json", str(out), timeout=180,
    )  # fmt: skip
    systems = json.loads(out.read_text())["systems"]
    for name in ("conveyor", "hf"):
        assert systems[name]["runs"][0]["output_tokens"] == 24 and systems[name]["runs"][0]["output_tok_s"] > 0, name
    assert "unavailable" in systems["hf-cb"] or systems["hf-cb"]["runs"][0]["output_tokens"] == 24
