"""Frozen configuration: the server's, built once from bin/serve's flags, and each process's view.

:class:`ServerConfig` is everything the flags say, checked when it is built, before any
process starts. Each child is handed its own part of it (:class:`FrontendConfig`,
:class:`WorkerConfig`, :class:`SchedulerProcessConfig`, and :class:`HttpConfig` when the
HTTP face is on) and reads nothing else: no field is
forwarded by hand from process to process, and nothing reads environment variables behind
the user's back. A view crosses to its process once, pickled by multiprocessing's spawn.

Modes are :class:`~conveyor.runtime.config_fields.Choice` enums, re-exported here.

This module imports neither torch nor anything that does: the frontend and the scheduler
load it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from conveyor.ipc.step_channel import StepChannels
from conveyor.ipc.transport import CLIENT_SEND_QUEUE, ServerAddresses, is_loopback, is_loopback_host
from conveyor.runtime.config_fields import (  # noqa: F401 (the modes re-exported: they are read from here)
    Attention,
    Batching,
    Choice,
    Device,
    Dtype,
    KVCacheDtype,
    PipelineSteps,
    PlanTransport,
    Policy,
    Preemption,
    Quantization,
    parse_choices,
    require_at_least,
)  # fmt: skip
from conveyor.runtime.http_config import HttpConfig


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and mode of the batcher.

    ``max_num_batched_tokens`` is the per-iteration token budget: decodes cost one
    token each, prompts are chunked to fit what remains. ``num_blocks`` KV blocks
    of ``block_size`` tokens each form the pool; ``max_model_len`` bounds
    prompt + output of any one request. ``num_cpu_blocks`` blocks of the same shape
    form the worker's CPU swap space (0: no swapping).

    Zero disables ``max_waiting`` and ``max_queue_time``. Times are in seconds except
    ``max_wait_ms``. docs/architecture.md describes what each knob does to a batch.
    """

    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    batching: Batching = Batching.CONTINUOUS
    # Do not start admitting for fewer than min_batch_size waiting requests unless the
    # oldest has waited max_wait_ms; running requests are never delayed by this.
    min_batch_size: int = 1
    max_wait_ms: float = 0.0
    # PRIORITY: higher AddRequest.priority first, raised by aging_rate per second waited.
    policy: Policy = Policy.FCFS
    aging_rate: float = 1.0
    # A request that does not fit now may be passed by at most this many smaller ones.
    max_bypass: int = 32
    preemption: Preemption = Preemption.AUTO
    num_cpu_blocks: int = 0
    # Cost model of Preemption.AUTO: bytes of one block (all layers; 0 = unknown, swap deemed
    # free), host<->device copy bandwidth in bytes/s, and prefill throughput in tokens/s.
    block_bytes: int = 0
    swap_bandwidth: float = 16e9
    prefill_rate: float = 20000.0
    # Copy prefix-cache blocks evicted from the GPU to the CPU swap space, so a later hit
    # (a conversation's next turn) swaps them back in instead of recomputing them.
    offload_evicted: bool = False
    # Bounded queue: past max_waiting a new request is refused ("overloaded"); a request
    # not yet admitted after max_queue_time seconds fails ("timeout").
    max_waiting: int = 4096
    max_queue_time: float = 600.0
    # Recent iterations kept for the stats/profile reply.
    iteration_log_size: int = 256
    # LoRA: the adapters requests may name (bin/serve --lora-modules), and how many distinct
    # ones a step may run (the worker's device slots, --max-loras).
    lora_names: tuple[str, ...] = ()
    max_loras: int = 4
    # Speculative decoding (scheduler/speculation.py): "ngram" proposes up to
    # num_speculative_tokens tokens per decode by prompt lookup (the last n tokens,
    # n from ngram_max down to ngram_min, matched in the request's own tokens); the worker
    # verifies them in the same step (rejection sampling). "draft": the worker's draft model,
    # the checkpoint speculative_model (same vocabulary), proposes them (worker/draft_model.py).
    # None: off.
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    speculative_model: str | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    # No proposals in a step with more decodes than this (0: no limit): a large batch's step
    # is compute-bound, and verifying proposals there costs about what they save
    # (docs/architecture.md, "Speculative decoding", the batch-size rule).
    speculative_max_batch: int = 32

    def __post_init__(self) -> None:
        parse_choices(self, batching=Batching, policy=Policy, preemption=Preemption)
        require_at_least(
            self, 0, "num_cpu_blocks", "max_waiting", "block_bytes", "max_wait_ms", "max_queue_time", "aging_rate"
        )
        require_at_least(self, 1, "min_batch_size", "max_loras")
        require_at_least(self, 0, "max_bypass", "speculative_max_batch")
        if self.swap_bandwidth <= 0 or self.prefill_rate <= 0:
            raise ValueError("swap_bandwidth and prefill_rate must be positive")
        require_at_least(self, 1, "iteration_log_size")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        require_at_least(self, 1, "num_blocks", "max_num_seqs", "max_num_batched_tokens")
        require_at_least(self, 2, "max_model_len")
        if self.speculative_method not in (None, "ngram", "draft"):
            raise ValueError(f"speculative_method must be 'ngram', 'draft' or None, got {self.speculative_method!r}")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative_method 'draft' and speculative_model (the draft checkpoint) go together")
        if (self.speculative_method is None) == (self.num_speculative_tokens >= 1):  # (else tokens silently ignored)
            raise ValueError(
                "speculative_method needs num_speculative_tokens >= 1"
                if self.speculative_method
                else "num_speculative_tokens needs speculative_method (ngram or draft)"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")

    @property
    def speculative_tokens(self) -> int:
        """Tokens a decode may propose per step (0: speculation off)."""
        return self.num_speculative_tokens if self.speculative_method is not None else 0


@dataclass(frozen=True)
class FrontendConfig:
    """The frontend process's view."""

    model_dir: str
    addresses: ServerAddresses
    max_model_len: int
    vocab_size: int  # rows of the model's embedding: token ids must be below it
    # Finished requests remembered for continuation (their token ids, up to max_model_len each).
    max_sessions: int = 1024
    profile: bool = True  # record latency profiles (bin/serve --profile / --no-profile)
    # Threads that tokenize long inputs off the event loop (0: everything on the loop).
    tokenizer_threads: int = 2
    # Inputs shorter than this many characters are tokenized on the loop (a thread hop costs more).
    tokenize_inline_chars: int = 512
    # A scheduler silent for hang_timeout s (0: never) while it owes requests is hung; on_hang:
    # "exit" or "wait" (conveyor.frontend.liveness; the scheduler watches its worker alike).
    hang_timeout: float = 30.0
    on_hang: str = "exit"
    # bin/serve --auth-keys: the CurveZMQ key directory (conveyor.ipc.transport's layout); None:
    # no authentication, any client that reaches the address is served.
    auth_keys: str | None = None
    # Data-parallel replicas (scheduler + worker pairs) behind this frontend, each reached at
    # ``addresses.replica(index)`` (conveyor.frontend.replicas).
    data_parallel_size: int = 1
    # bin/serve --client-send-queue: replies queued for one client connection before it counts
    # as not reading and its requests are dropped (conveyor.ipc.transport.CLIENT_SEND_QUEUE
    # says what the default implies; 0: no bound).
    client_send_queue: int = CLIENT_SEND_QUEUE
    # bin/serve --max-logprobs: the most top log-probabilities a request may ask for.
    max_logprobs: int = 20
    # bin/serve --enable-lora-loading: clients may load and unload LoRA adapters while it
    # serves (load_lora / unload_lora); off by default, since a load reads any directory the
    # client names with the server's file permissions.
    enable_lora_loading: bool = False
    # bin/serve --enable-rl-control: clients may update the weights (from a directory the
    # client names, or a trainer's group), put the server to sleep, wake it, pause and continue
    # it (docs/rl.md); off by default for the same reason.
    enable_rl_control: bool = False
    # bin/serve --max-waiting: a ZeroMQ client may hold a quarter of it in sequences in flight
    # (conveyor.frontend.shares; 0: no bound).
    max_waiting: int = 0

    def __post_init__(self) -> None:
        require_at_least(self, 1, "data_parallel_size")
        require_at_least(
            self, 0, "tokenizer_threads", "tokenize_inline_chars", "client_send_queue", "max_logprobs", "max_waiting"
        )


@dataclass(frozen=True)
class RunnerConfig:
    """What a model runner (:class:`conveyor.worker.model_runner.ModelRunner`) is built from,
    every default written here once: the worker's view holds one (:attr:`WorkerConfig.runner`),
    the in-process engine builds one, the tests and benchmarks too.

    ``device``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (resolved, per rank, by
    :func:`conveyor.worker.main.build_runner`; a runner takes a concrete one). ``dtype``: a
    :class:`Dtype` name, or a torch dtype (this module does not import torch). The KV pool is
    ``num_blocks`` blocks or as many as fit in ``kv_cache_memory_bytes`` (exactly one: the
    runner refuses anything else), stored in ``kv_cache_dtype`` (``auto``: the model's dtype;
    ``fp8``/``int8``: 8 bits with static per-layer scales, docs/architecture.md); the CPU
    swap space ``num_cpu_blocks`` blocks or ``swap_space_bytes`` (None for both: none, or the
    device's default through build_runner). ``max_num_seqs`` (the scheduler's) bounds a step's
    rows and sizes the static decode buffers; ``enforce_eager``: no CUDA graphs for decode
    steps; ``pad_decode``: pad decode batches to the graph buckets (None: when graphs are used).
    ``num_speculative_tokens``: the scheduler's speculative_tokens, the verify width the static
    buffers are sized for. LoRA (conveyor.worker.lora) is on with ``lora_modules`` ((name, PEFT
    directory) pairs registered at start) or ``enable_lora``, with ``max_loras`` device slots,
    ranks up to ``max_lora_rank`` and ``max_cpu_loras`` host copies (None: as many as slots;
    the others spilled to local disk).
    ``speculative_model``: the draft checkpoint of speculative decoding, loaded beside the model.
    ``first_device``: the GPU of rank 0 (worker.parallel.rank_device); ``num_threads``: torch's
    CPU threads (None: torch's default), set by build_runner.
    """

    model_dir: str
    device: str = Device.CPU
    dtype: Dtype = Dtype.AUTO  # or a torch.dtype, taken as it is
    quantization: Quantization = Quantization.AUTO  # bin/serve --quantization (worker.quantization)
    block_size: int = SchedulerConfig.block_size
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    attention: Attention = Attention.AUTO
    num_cpu_blocks: int | None = None
    swap_space_bytes: int | None = None
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    enforce_eager: bool = False
    pad_decode: bool | None = None
    num_speculative_tokens: int = 0
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    max_loras: int = SchedulerConfig.max_loras
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    speculative_model: str | None = None
    first_device: int = 0
    num_threads: int | None = None
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        parse_choices(self, attention=Attention, quantization=Quantization, kv_cache_dtype=KVCacheDtype)
        if isinstance(self.dtype, str):
            parse_choices(self, dtype=Dtype)

    @property
    def lora_enabled(self) -> bool:
        return bool(self.lora_modules) or self.enable_lora


#: The KV cache's size when no block count is given: bin/serve's ``--kv-cache-memory`` default and the engine's.
KV_CACHE_MEMORY_BYTES = 1 << 30


@dataclass(frozen=True)
class WorkerConfig:
    """The worker process's view: its model runner's config (``runner``, which says what each
    of its fields does; its ``device`` may be ``auto``, resolved per rank by the worker, and
    its ``num_threads`` is the setting, shared among the ranks of a machine) and the process
    around the runner. :func:`conveyor.assembly.build.worker_config` builds it from settings."""

    runner: RunnerConfig
    addresses: ServerAddresses
    channels: StepChannels  # plans from the scheduler, results back
    pipeline: PipelineSteps = PipelineSteps.AUTO  # launch step N+1 before finishing step N
    profile: bool = True  # record latency profiles (bin/serve --profile / --no-profile)
    # Tensor parallelism (bin/serve --tensor-parallel-size): this worker is rank
    # ``tensor_parallel_rank`` of ``tensor_parallel_size`` (one process each, every one reading
    # every plan; only rank 0 sends results). The ranks' process group meets at
    # ``distributed_init_method`` (a file:// in the run directory, ServerConfig.worker_ranks);
    # ``distributed_timeout_s`` bounds its start-up and every collective, so a rank whose peer
    # died raises instead of waiting forever.
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    # A mixture-of-experts model's ranks each hold 1/size of the experts whole (bin/serve
    # --expert-parallel) rather than 1/size of every expert's features (runtime.tensor_shards).
    expert_parallel: bool = False
    distributed_init_method: str = ""
    distributed_timeout_s: float = 300.0
    # Rank 0 is the planning process (conveyor.Engine: conveyor.engine.ranks) and reads no plans:
    # the plan channel has a reader per other rank, rank r >= 1 being reader r - 1.
    rank0_in_process: bool = False
    # CPU threads (conveyor.worker.cpu_threads): this worker is slot ``cpu_slot`` of the
    # ``cpu_slots`` worker processes on its machine (every replica's ranks there), whose threads
    # share its cores; on a CPU device ``cpu_bind`` (bin/serve --cpu-bind) binds them to the
    # slot's own cores.
    cpu_bind: bool = True
    cpu_slot: int = 0
    cpu_slots: int = 1

    def __post_init__(self) -> None:
        parse_choices(self, pipeline=PipelineSteps)
        require_at_least(self, 1, "cpu_slots")
        if not 0 <= self.cpu_slot < self.cpu_slots:
            raise ValueError(f"cpu_slot {self.cpu_slot} outside 0..{self.cpu_slots - 1}")
        Device.parse(self.runner.device, "device")  # (a rank's concrete device is the worker's to resolve)
        require_at_least(self, 1, "tensor_parallel_size")
        if self.runner.num_blocks is not None:  # (else sized from kv_cache_memory_bytes by the worker)
            require_at_least(self.runner, 1, "num_blocks")
        if not 0 <= self.tensor_parallel_rank < self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_rank {self.tensor_parallel_rank} outside 0..{self.tensor_parallel_size - 1}"
            )
        readers = self.tensor_parallel_size - self.rank0_in_process
        if self.channels.plans.readers != readers:
            raise ValueError(
                f"the plan channel has {self.channels.plans.readers} readers for {readers} tensor-parallel ranks"
            )
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s}")


def rank_process_name(worker: str, rank: int) -> str:
    """What bin/serve and the logs call tensor-parallel rank ``rank`` of the worker called
    ``worker``: ``worker`` itself for rank 0 (the rank that reports the pool and sends results,
    so a server of one rank has the names it had before), ``<worker>-rank<r>`` for the others."""
    return worker if rank == 0 else f"{worker}-rank{rank}"


@dataclass(frozen=True)
class SchedulerProcessConfig:
    """The scheduler process's view: the batcher's config and what the loop around it needs."""

    scheduler: SchedulerConfig
    addresses: ServerAddresses
    channels: StepChannels  # plans to the worker, results back
    eos_token_ids: list[int]
    vocab_size: int
    profile: bool = True  # record latency profiles (bin/serve --profile / --no-profile)
    overlap: bool = True  # plan step N+1 while the worker runs step N (bin/serve --no-overlap)
    # A worker silent for hang_timeout s (0: never) with a plan in flight is hung; on_hang:
    # "exit" or "wait" (conveyor.scheduler.liveness).
    hang_timeout: float = 30.0
    on_hang: str = "exit"
    # bin/serve --asleep-requests: requests that arrive while the server sleeps "wait" for the
    # wake or are "refuse"d (conveyor.scheduler.control_gate).
    asleep_requests: str = "wait"

    def __post_init__(self) -> None:
        require_at_least(self, 0, "hang_timeout")
        if self.asleep_requests not in ("wait", "refuse"):
            raise ValueError(f"asleep_requests must be 'wait' or 'refuse', got {self.asleep_requests!r}")


@dataclass(frozen=True)
class ServerConfig:
    """One server: where it listens, what it serves, and each process's view of it.

    The views share ``addresses`` and ``channels``. The scheduler's pool fields
    (``num_blocks``, ``num_cpu_blocks``, ``block_bytes``) are the worker's to tell, since it
    sizes the pool from device memory: in :attr:`scheduler` they are what the flags say, or
    the least valid value, and :meth:`sized_scheduler` returns the view with what the worker
    reported.
    """

    model_dir: str
    demo: bool  # the built-in demo checkpoint (random weights)
    run_dir: str  # private directory of the internal ipc sockets and plan rings (bin/serve removes it)
    addresses: ServerAddresses
    channels: StepChannels
    frontend: FrontendConfig
    worker: WorkerConfig
    scheduler: SchedulerProcessConfig
    http: HttpConfig | None = None  # None: no --http-port nor --metrics-port, no HTTP process
    # With several replicas: when one replica's scheduler or worker dies, fail only its requests
    # and serve on with the others (False: stop the whole server, as a single replica does).
    serve_on_replica_death: bool = True
    # Multi-node tensor parallelism (bin/serve --nnodes/--node-rank/--dist-init-addr): this is
    # node ``node_rank`` of ``nnodes``, running tensor-parallel ranks ``node_ranks()``. Node 0
    # runs the frontend, scheduler (and HTTP process) beside its ranks; the others run ranks
    # only. ``dist_init_addr`` (HOST:PORT, node 0's) is where the process group meets (TCP
    # store on PORT), the supervisors' node link (PORT + 1, conveyor.assembly.node_link) and,
    # from PORT + 2 on, the other nodes' ranks' plan sockets (:func:`remote_plans_address`).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # The sockets between nodes are CurveZMQ with ``cluster_key`` (a key pair file every node
    # holds, transport.ClusterKey); ``insecure_cluster`` leaves them open (loopback only).
    cluster_key: str | None = None
    insecure_cluster: bool = False

    def __post_init__(self) -> None:
        require_at_least(self, 1, "nnodes")
        check_faces_keyed_alike(self)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} outside 0..{self.nnodes - 1}")
        if self.nnodes == 1:
            return
        if self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
        host, _ = dist_init_host_port(self.dist_init_addr)
        if (self.cluster_key is None) != self.insecure_cluster:
            raise ValueError(
                "--nnodes > 1 needs one of --cluster-key FILE (bin/keygen DIR --cluster) and --insecure-cluster"
            )
        if self.insecure_cluster and not is_loopback_host(host):
            raise ValueError(f"--insecure-cluster is for loopback only: {host} is reachable from other hosts")
        size = self.worker.tensor_parallel_size
        if size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size {size} does not divide by --nnodes {self.nnodes}")
        if self.data_parallel_size > 1:
            raise ValueError("--nnodes > 1 is tensor parallelism across nodes: --data-parallel-size must be 1")

    def node_ranks(self) -> range:
        """The tensor-parallel ranks this node runs: an equal, consecutive share per node."""
        per_node = self.worker.tensor_parallel_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def data_parallel_size(self) -> int:
        return self.frontend.data_parallel_size

    def replica(self, index: int) -> ServerConfig:
        """Data-parallel replica ``index`` as a server of its own: the same flags, with its own
        internal addresses (:meth:`ServerAddresses.replica`) and plan rings (suffixed
        ``.<index>``) in its worker's and scheduler's views. Replica 0 is this config."""
        if index == 0:
            return self
        addresses = self.addresses.replica(index)
        plans, results = self.channels.plans, self.channels.results
        channels = StepChannels(
            replace(plans, zmq_address=addresses.plans, ring_path=plans.ring_path and f"{plans.ring_path}.{index}"),
            replace(
                results, zmq_address=addresses.results, ring_path=results.ring_path and f"{results.ring_path}.{index}"
            ),
        )
        return replace(
            self,
            addresses=addresses,
            channels=channels,
            worker=replace(
                self.worker,
                addresses=addresses,
                channels=channels,
                runner=replace(self.worker.runner, first_device=index * self.worker.tensor_parallel_size),
                cpu_slot=index * len(self.node_ranks()),
                cpu_slots=self.data_parallel_size * len(self.node_ranks()),
            ),
            scheduler=replace(self.scheduler, addresses=addresses, channels=channels),
        )

    def worker_ranks(self) -> list[WorkerConfig]:
        """The worker view of each tensor-parallel rank this node runs, lowest first. On one
        node their process group meets at a file beside this server's plan socket in the run
        directory (so each data-parallel replica's ranks meet apart), removed with the run
        directory; across nodes, at ``tcp://`` ``dist_init_addr`` (node 0's rank 0 hosts
        the store)."""
        if self.nnodes > 1:
            rendezvous = f"tcp://{self.dist_init_addr}"
        else:
            rendezvous = "file://" + self.worker.addresses.plans.removeprefix("ipc://") + "-tp-rendezvous"
        ranks = self.node_ranks()
        return [
            replace(
                self.worker,
                tensor_parallel_rank=rank,
                distributed_init_method=rendezvous,
                cpu_slot=self.worker.cpu_slot + i,  # (replica(index) set the replica's first)
                cpu_slots=self.data_parallel_size * len(ranks),
            )
            for i, rank in enumerate(ranks)
        ]

    def sized_scheduler(self, num_blocks: int, num_cpu_blocks: int, block_bytes: int) -> SchedulerProcessConfig:
        """The scheduler's view with the KV pool the worker reported (ValueError if it is unusable)."""
        sized = replace(
            self.scheduler.scheduler, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks, block_bytes=block_bytes
        )
        return replace(self.scheduler, scheduler=sized)


def check_faces_keyed_alike(config: ServerConfig) -> None:
    """One auth story across the faces: a server that keys one face (``--api-key`` for HTTP,
    ``--auth-keys`` for ZeroMQ) does not start with the other one open to other hosts without
    a key (a key on one face was no protection while the other served ``generate`` and
    ``load_lora`` to anyone). Loopback faces stay open to local users, as without keys."""
    http = config.http
    if http is None or http.http_port is None:
        return
    zmq_keyed, http_keyed = config.frontend.auth_keys is not None, bool(http.api_keys)
    if http_keyed and not zmq_keyed and not is_loopback(config.addresses.client):
        raise ValueError(
            f"--api-key keys the HTTP API, but the ZeroMQ client socket {config.addresses.client} is open to other "
            "hosts: "
            "add --auth-keys DIR (bin/keygen) or bind --host to loopback"
        )
    if zmq_keyed and not http_keyed and not is_loopback_host(http.http_host):
        raise ValueError(
            f"--auth-keys keys the ZeroMQ socket, but the HTTP API on {http.http_host} is open to other hosts: "
            "add --api-key (or --api-key-file) or bind --http-host to loopback"
        )


def dist_init_host_port(address: str) -> tuple[str, int]:
    """``--dist-init-addr`` ``HOST:PORT`` split; ValueError for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {address!r}")
    return host, int(port)


def remote_plans_address(dist_init_addr: str) -> str:
    """Where node 0's scheduler sends plans to the other nodes' ranks: ``tcp://HOST:PORT+2``
    for the first of them, the next port for each next one (:meth:`ChannelSpec.reader_address`)."""
    host, port = dist_init_host_port(dist_init_addr)
    return f"tcp://{host}:{port + 2}"


def replica_process_name(process: str, index: int) -> str:
    """What bin/serve and the profile call ``process`` ("worker", "scheduler") of replica
    ``index``: replica 0's keep the plain names a single-replica server has, the others get
    ``.<index>`` ("worker.1")."""
    return process if index == 0 else f"{process}.{index}"


def replica_of_process(name: str) -> int | None:
    """The replica whose worker or scheduler :func:`replica_process_name` called ``name`` (a
    tensor-parallel rank's name, :func:`rank_process_name`, is its worker's); None for the
    frontend, the HTTP process or any other name."""
    process, _, index = name.split("-rank", 1)[0].partition(".")
    if process not in ("worker", "scheduler"):
        return None
    return int(index) if index else 0
