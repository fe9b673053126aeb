"""bin/serve: start the worker, scheduler and frontend processes and keep them honest.

Startup: the worker loads the model and sizes the KV pool while the frontend
loads the tokenizer (and the HTTP process, with ``--http-port`` or ``--metrics-port``,
binds its ports); the scheduler starts once the worker has reported its
block count. One line with the client address and ``ready`` is printed when
all of them have said ready. With ``--tensor-parallel-size N`` the worker is N
processes (ranks, each watched like any child); rank 0 reports the KV pool the
ranks agreed on (conveyor.worker.main). With ``--data-parallel-size M`` there are M
such worker + scheduler pairs (replica 0's processes named as a single server's,
replica i's ``worker.i`` and ``scheduler.i``; each its own internal sockets and
rings, :meth:`ServerConfig.replica`) behind the one frontend
(:mod:`conveyor.frontend.replicas`).

Supervision: if any child exits, every in-flight request gets an error (the
frontend is told to fail them before it exits), the other children are
stopped, and serve exits non-zero. The exception is a replica's death while
another replica lives (with ``--serve-on-replica-death``, the default): the
frontend is told (``ProcessFailed``) and fails that replica's requests alone, the
replica's other processes are stopped, and the others serve on; the server stops
when its last replica dies. SIGINT/SIGTERM stop everything within a few
seconds. Children also get SIGTERM from the kernel if serve itself is killed
(PR_SET_PDEATHSIG), so no process is ever orphaned.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TypeVar

import zmq

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.frontend.main import run_frontend
from conveyor.http.main import run_http
from conveyor.ipc import codec, step_channel, transport
from conveyor.ipc.messages import ProcessFailed, ProcessReady, Shutdown
from conveyor.ipc.transport import ServerAddresses
from conveyor.runtime.config import (
    Attention,
    Choice,
    Device,
    Dtype,
    FrontendConfig,
    HttpConfig,
    PipelineSteps,
    PlanTransport,
    SchedulerConfig,
    SchedulerProcessConfig,
    ServerConfig,
    WorkerConfig,
    rank_process_name,
    replica_of_process,
    replica_process_name,
)
from conveyor.scheduler.main import run_scheduler
from conveyor.worker.main import run_worker

T = TypeVar("T")

STARTUP_TIMEOUT_S = 600.0
SHUTDOWN_GRACE_S = 3.0


class StartupError(RuntimeError):
    pass


def build_parser() -> argparse.ArgumentParser:
    """bin/serve's flags. Their defaults are the config classes' own (``SchedulerConfig.max_num_seqs``
    ...) and their choices the mode enums' names, so neither is written twice."""
    p = argparse.ArgumentParser(prog="serve", description="Serve a Llama-family model with continuous batching.")
    p.add_argument("--model", help="local HF checkpoint directory (config.json + safetensors); default: the built-in demo model")
    p.add_argument("--host", default="127.0.0.1", help="client address host, or a full ipc:// / tcp:// address")
    p.add_argument("--port", type=int, default=7700)
    p.add_argument(
        "--auth-keys",
        metavar="DIR",
        help="require CurveZMQ authentication: DIR holds the server key pair and the allowed client keys (make them with bin/keygen)",
    )
    _choice(p, "--device", Device.AUTO, "auto: cuda when available")
    _choice(p, "--dtype", Dtype.AUTO)
    p.add_argument("--block-size", type=int, default=SchedulerConfig.block_size, help="tokens per KV-cache block")
    p.add_argument("--num-kv-blocks", type=int, help="KV-cache blocks (default: sized from --kv-cache-memory)")
    p.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB for the KV cache when --num-kv-blocks is not given")
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs, help="most sequences in one iteration")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens, help="token budget of one iteration")
    p.add_argument("--max-model-len", type=int, help="prompt + output limit (default: the model's max_position_embeddings)")
    _choice(p, "--batching", SchedulerConfig.batching, "static: run each batch to completion before forming the next (a baseline for benchmarks)")
    add_scheduling_arguments(p)
    _switch(p, "--overlap", True, "form step N+1's plan while the worker runs step N (--no-overlap: one plan at a time, for comparison)")
    _choice(p, "--plan-transport", PlanTransport.SHM, "scheduler <-> worker hop: shm (shared-memory rings) or zmq (ZeroMQ ipc sockets)")
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=WorkerConfig.tensor_parallel_size,
        help="worker processes the model is split across (rank r on cuda:r; on CPU, processes on gloo)",
    )
    p.add_argument(
        "--distributed-timeout",
        dest="distributed_timeout_s",
        type=float,
        default=WorkerConfig.distributed_timeout_s,
        help="seconds the tensor-parallel ranks wait for each other (start-up, every collective) before failing",
    )
    p.add_argument(
        "--data-parallel-size",
        type=_positive_int,
        default=FrontendConfig.data_parallel_size,
        help="independent scheduler + worker replicas behind the one frontend, each with its own KV cache "
        "(a new request goes to the least loaded, a continuation to the replica that ran its earlier turn)",
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
    p.add_argument(
        "--tokenizer-threads",
        type=_non_negative_int,
        default=FrontendConfig.tokenizer_threads,
        help="frontend threads that tokenize inputs of 512+ characters off its event loop (0: all on the loop)",
    )
    _switch(p, "--profile", True, "record per-process latency profiles for bin/profile (measured cost: docs/benchmarks.md)")
    add_http_arguments(p)
    return p


def _choice(p: argparse._ActionsContainer, flag: str, default: Choice, help: str | None = None) -> None:
    """A flag that picks a mode: its choices are the names of ``default``'s enum, so a mode
    added to the enum is a value of the flag at once, and the default is the config's own."""
    p.add_argument(flag, default=default, choices=type(default).names(), help=help)


def _switch(p: argparse._ActionsContainer, flag: str, default: bool, help: str) -> None:
    """An on/off flag (``--x`` / ``--no-x``) whose default is the config's own."""
    p.add_argument(flag, default=default, action=argparse.BooleanOptionalAction, help=help)


def add_http_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP face (HttpConfig): off unless a port is given."""
    g = p.add_argument_group("HTTP (OpenAI-compatible API and Prometheus metrics)")
    g.add_argument("--http-port", type=_port, help="serve the OpenAI-compatible API (and /health, /metrics) on this port (0: any free one)")
    g.add_argument("--http-host", default=HttpConfig.http_host, help="address the HTTP listeners bind (default: loopback only)")
    g.add_argument("--metrics-port", type=_port, help="serve /metrics and /health on this port (also without --http-port)")
    g.add_argument(
        "--served-model-name",
        help="the model name clients send and /v1/models lists (default: the --model directory's name; conveyor-demo for the demo)",
    )


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def add_scheduling_arguments(p: argparse.ArgumentParser) -> None:
    """The batcher's policy knobs (SchedulerConfig; docs/architecture.md describes each)."""
    g = p.add_argument_group("scheduling")
    _choice(g, "--policy", SchedulerConfig.policy, "order of the waiting line")
    g.add_argument("--aging-rate", type=float, default=SchedulerConfig.aging_rate, help="priority points a waiting request gains per second")
    _choice(g, "--preemption", SchedulerConfig.preemption, "what a preempted request loses; auto: the cheaper of swap and recompute per victim")
    g.add_argument("--num-cpu-blocks", type=int, help="CPU swap space in blocks (instead of --swap-space)")
    g.add_argument(
        "--swap-space", type=float, help="CPU swap space in GiB (default: 4 with --device cuda, 0 on CPU)"
    )
    g.add_argument("--min-batch-size", type=int, default=SchedulerConfig.min_batch_size, help="do not start admitting for fewer waiting requests...")
    g.add_argument("--max-wait-ms", type=float, default=SchedulerConfig.max_wait_ms, help="...unless the oldest has waited this long")
    g.add_argument("--max-bypass", type=int, default=SchedulerConfig.max_bypass, help="times a request that does not fit may be passed by smaller ones")
    g.add_argument("--max-waiting", type=int, default=SchedulerConfig.max_waiting, help="queue bound: new requests past it get 'overloaded' (0: none)")
    g.add_argument("--max-queue-time", type=float, default=SchedulerConfig.max_queue_time, help="seconds a request may wait to start before 'timeout' (0: none)")
    _switch(g, "--offload-evicted", SchedulerConfig.offload_evicted, "copy prefix-cache blocks evicted from the GPU to the CPU swap space")
    g.add_argument("--swap-bandwidth", type=float, default=SchedulerConfig.swap_bandwidth / 1e9, help="GB/s host<->device, for --preemption auto")
    g.add_argument("--prefill-rate", type=float, default=SchedulerConfig.prefill_rate, help="prefill tokens/s, for --preemption auto")
    g.add_argument("--max-sessions", type=int, default=FrontendConfig.max_sessions, help="finished requests remembered for continuation")
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=FrontendConfig.max_logprobs,
        help="the most top log-probabilities a request may ask for (logprobs, prompt_logprobs); more is refused",
    )


def server_config(args: argparse.Namespace, run_dir: str) -> ServerConfig:
    """The one place flags become configuration; ValueError or OSError when they do not make one.

    A flag whose name is a field of a view sets that field wherever it appears (``--profile``
    in all three views, ``--block-size`` in the worker's and the scheduler's); the others
    (``--model``, ``--host``, ``--threads``, sizes in GiB or GB/s ...) are converted here. The
    scheduler's pool fields wait for the worker (ServerConfig.sized_scheduler).
    """
    model_dir, demo = resolve_model(args.model)
    model = ModelConfig.from_dir(model_dir)
    if args.auth_keys is not None:
        transport.check_auth_keys(args.auth_keys)
    max_model_len = model_length(model, args.max_model_len)
    addresses = ServerAddresses.in_run_dir(run_dir, transport.client_address(args.host, args.port))
    channels = step_channel.StepChannels.for_server(
        run_dir,
        addresses.plans,
        addresses.results,
        shm=args.plan_transport == PlanTransport.SHM,
        plan_readers=args.tensor_parallel_size,
    )
    worker = _view(
        WorkerConfig,
        args,
        model_dir=model_dir,
        addresses=addresses,
        channels=channels,
        num_blocks=args.num_kv_blocks,
        kv_cache_memory_bytes=None if args.num_kv_blocks else _gib(args.kv_cache_memory),
        num_threads=args.threads,
        pipeline=args.pipeline_steps,
        swap_space_bytes=None if args.swap_space is None else _gib(args.swap_space),
    )
    frontend = _view(
        FrontendConfig, args, model_dir=model_dir, addresses=addresses, max_model_len=max_model_len, vocab_size=model.vocab_size
    )
    batcher = _view(
        SchedulerConfig,
        args,
        num_blocks=args.num_kv_blocks or 1,
        num_cpu_blocks=args.num_cpu_blocks or 0,
        max_model_len=max_model_len,
        swap_bandwidth=args.swap_bandwidth * 1e9,
    )
    scheduler = _view(
        SchedulerProcessConfig,
        args,
        scheduler=batcher,
        addresses=addresses,
        channels=channels,
        eos_token_ids=list(model.eos_token_ids),
        vocab_size=model.vocab_size,
    )
    http = None
    if args.http_port is not None or args.metrics_port is not None:
        name = args.served_model_name or ("conveyor-demo" if demo else Path(model_dir).resolve().name)
        http = _view(HttpConfig, args, addresses=addresses, served_model_name=name, max_model_len=max_model_len)
    return ServerConfig(
        model_dir, demo, run_dir, addresses, channels, frontend, worker, scheduler, http,
        serve_on_replica_death=args.serve_on_replica_death,
    )


def model_length(model: ModelConfig, max_model_len: int | None) -> int:
    """The prompt + output limit: ``max_model_len`` (--max-model-len), by default the model's
    ``max_position_embeddings``, which it may not exceed (ValueError). bin/serve and the
    in-process engine (:mod:`conveyor.engine`) both take it from here."""
    length = max_model_len or model.max_position_embeddings
    if length > model.max_position_embeddings:
        raise ValueError(f"--max-model-len {length} exceeds the model's {model.max_position_embeddings}")
    return length


def _view(view: type[T], args: argparse.Namespace, **fields: object) -> T:
    """``view`` (a config dataclass) from the flags named as its fields, and ``fields``, which
    win over a flag of the same name (its value converted: a length resolved, GB/s to bytes/s)."""
    named = {f.name: getattr(args, f.name) for f in dataclasses.fields(view) if hasattr(args, f.name)}
    return view(**{**named, **fields})


def _gib(gib: float) -> int:
    return int(gib * 2**30)


class Server:
    """The children (worker, frontend, scheduler, and the HTTP process when asked for) and
    the sockets serve uses to talk to them."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.control = transport.socket(self.ctx, zmq.PULL, config.addresses.control, bind=True)
        self.frontend_control = transport.socket(self.ctx, zmq.PUSH, config.addresses.frontend_control, bind=False)
        self.mp = mp.get_context("spawn")
        self.procs: dict[str, mp.process.BaseProcess] = {}
        self.ready: dict[str, ProcessReady] = {}
        self.dead_replicas: set[int] = set()  # data-parallel replicas stopped while the others serve on

    # ------------------------------------------------------------------ startup

    def start(self) -> None:
        config = self.config
        replicas = [config.replica(index) for index in range(config.data_parallel_size)]
        try:
            for replica in replicas:
                step_channel.create_rings(replica.channels)
        except OSError as exc:
            raise StartupError(f"cannot create the shared-memory plan rings ({exc}); --plan-transport zmq avoids them") from None
        first = {"frontend"}
        for index, replica in enumerate(replicas):  # every data-parallel replica's workers
            for rank in replica.worker_ranks():  # every tensor-parallel rank, each watched like any child
                name = rank_process_name(replica_process_name("worker", index), rank.tensor_parallel_rank)
                self._spawn(name, run_worker, rank)
                first.add(name)
        self._spawn("frontend", run_frontend, config.frontend)
        if config.http is not None:  # it answers 503 until the scheduler is up
            self._spawn("http", run_http, config.http)
            first.add("http")
        self._wait_ready(first)
        schedulers = set()
        for index, replica in enumerate(replicas):
            worker = self.ready[replica_process_name("worker", index)].info
            try:
                scheduler = replica.sized_scheduler(
                    num_blocks=int(worker["num_blocks"]),
                    num_cpu_blocks=int(worker.get("num_cpu_blocks", 0)),
                    block_bytes=int(worker.get("block_bytes", 0)),
                )
            except ValueError as exc:
                raise StartupError(str(exc)) from None
            name = replica_process_name("scheduler", index)
            self._spawn(name, run_scheduler, scheduler)
            schedulers.add(name)
        self._wait_ready(schedulers)

    def _spawn(self, name: str, target, config) -> None:
        proc = self.mp.Process(target=target, args=(config,), name=f"conveyor-{name}")
        proc.start()
        self.procs[name] = proc

    def _wait_ready(self, names: set[str]) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        waiting = set(names)
        while waiting:
            if _STOP_SIGNAL:
                raise StartupError("interrupted during startup")
            for name in waiting:
                if not self.procs[name].is_alive():
                    raise StartupError(f"{name} process exited during startup (exit code {self.procs[name].exitcode})")
            if time.monotonic() > deadline:
                raise StartupError(f"timed out waiting for {', '.join(sorted(waiting))} to start")
            if not self.control.poll(200):
                continue
            msg = codec.decode(self.control.recv())
            if isinstance(msg, ProcessFailed):
                raise StartupError(msg.reason)
            if isinstance(msg, ProcessReady):
                # By pid: every replica's processes report the same names ("worker", "scheduler").
                name = next((n for n, p in self.procs.items() if p.pid == msg.pid), msg.process)
                self.ready[name] = msg
                waiting.discard(name)
                print(f"conveyor: {name} ready (pid {msg.pid})", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ supervision

    def supervise(self) -> int:
        """Block until a signal or a child's death; return serve's exit code."""
        sentinels = {p.sentinel: name for name, p in self.procs.items()}
        while True:
            if _STOP_SIGNAL:
                self.stop("server shutting down")
                return 0
            done = mp.connection.wait(list(sentinels), timeout=0.2)
            if done:
                name = sentinels[done[0]]
                self.procs[name].join(1.0)
                code = self.procs[name].exitcode
                time.sleep(0.1)  # a signal sent to the whole group reaches us a moment later
                if _STOP_SIGNAL:
                    self.stop("server shutting down")
                    return 0
                replica = replica_of_process(name)
                if replica is not None and self._serves_on_without(replica):
                    print(
                        f"conveyor: {name} process died (exit code {code}); stopping replica {replica}, serving on the others",
                        file=sys.stderr,
                        flush=True,
                    )
                    for gone in self.stop_replica(replica, name, f"{name} process died (exit code {code})"):
                        sentinels.pop(self.procs[gone].sentinel, None)
                    continue
                print(f"conveyor: {name} process died (exit code {code}); stopping", file=sys.stderr, flush=True)
                self.stop(f"{name} process died (exit code {code})")
                return 1

    def _serves_on_without(self, replica: int) -> bool:
        """Whether the server keeps serving when ``replica`` dies: --serve-on-replica-death
        (the default) and another replica is still alive."""
        if not self.config.serve_on_replica_death:
            return False
        others = set(range(self.config.data_parallel_size)) - self.dead_replicas - {replica}
        return bool(others)

    def stop_replica(self, replica: int, process: str, reason: str) -> list[str]:
        """Replica ``replica`` lost ``process``: tell the frontend (which fails that replica's
        requests alone and routes nothing there again), stop the replica's other processes,
        and return the names of all of them."""
        self.dead_replicas.add(replica)
        transport.send(self.frontend_control, ProcessFailed(process, reason))
        names = [name for name in self.procs if replica_of_process(name) == replica]
        _terminate([self.procs[name] for name in names])
        return names

    def stop(self, reason: str) -> None:
        """Fail in-flight requests through the frontend, then stop every child."""
        frontend = self.procs.get("frontend")
        if frontend is not None and frontend.is_alive():
            transport.send(self.frontend_control, Shutdown(reason))
            frontend.join(SHUTDOWN_GRACE_S)
        _terminate(list(self.procs.values()))

    def close(self) -> None:
        self.control.close(linger=0)
        self.frontend_control.close(linger=0)
        self.ctx.term()
        for index in range(self.config.data_parallel_size):
            step_channel.remove_rings(self.config.replica(index).channels)
        shutil.rmtree(self.config.run_dir, ignore_errors=True)


def _terminate(procs: list[mp.process.BaseProcess]) -> None:
    """SIGTERM every one of ``procs`` still alive, give them :data:`SHUTDOWN_GRACE_S` in all
    to exit, then SIGKILL any left."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


_STOP_SIGNAL: list[int] = []


def _on_signal(signum, frame) -> None:
    _STOP_SIGNAL.append(signum)


def _print_http_addresses(info: dict) -> None:
    if "api" in info:
        print(f"conveyor: OpenAI-compatible API on {info['api']}/v1 (and {info['api']}/health, /metrics)", file=sys.stderr, flush=True)
    if "metrics" in info:
        print(f"conveyor: Prometheus metrics on {info['metrics']}", file=sys.stderr, flush=True)


def warn_if_exposed(config: ServerConfig) -> None:
    """One line on stderr for each face reachable from other hosts with nobody checked: the
    client socket without --auth-keys, and the HTTP listeners (they have no authentication)."""
    if config.frontend.auth_keys is None and not transport.is_loopback(config.addresses.client):
        print(
            f"conveyor: WARNING: {config.addresses.client} is reachable from other hosts and --auth-keys is not set: "
            "anyone who can connect can use this server",
            file=sys.stderr,
            flush=True,
        )
    if config.http is not None and not transport.is_loopback_host(config.http.http_host):
        print(
            f"conveyor: WARNING: the HTTP listeners on {config.http.http_host} are reachable from other hosts "
            "and have no authentication (put an authenticating proxy in front of them)",
            file=sys.stderr,
            flush=True,
        )


def resolve_model(model: str | None) -> tuple[str, bool]:
    """The checkpoint directory to serve and whether it is the demo model."""
    if model is None:
        from conveyor.checkpoints.demo.checkpoint import demo_checkpoint_dir

        return str(demo_checkpoint_dir()), True
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise StartupError(f"--model {model}: no config.json there (a local HF checkpoint directory is required)")
    return str(path), False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    run_dir = transport.make_run_dir()
    try:
        config = server_config(args, run_dir)
    except (StartupError, ValueError, OSError) as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"conveyor: {exc}", file=sys.stderr)
        return 2
    warn_if_exposed(config)
    server = Server(config)
    try:
        server.start()
    except StartupError as exc:
        print(f"conveyor: startup failed: {exc}", file=sys.stderr, flush=True)
        server.stop("startup failed")
        server.close()
        return 1
    worker = server.ready["worker"].info
    if "http" in server.ready:
        _print_http_addresses(server.ready["http"].info)
    what = "demo model (random weights: output is gibberish)" if config.demo else f"model {config.model_dir}"
    try:
        print(
            f"conveyor ready on {config.addresses.client} serving {what} "
            f"on {worker.get('device')} with {worker['num_blocks']} KV blocks of {config.worker.block_size} tokens"
            + (f" (replica 0 of {config.data_parallel_size})" if config.data_parallel_size > 1 else ""),
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
