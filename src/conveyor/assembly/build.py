"""Settings become configuration here, for both faces of Conveyor.

bin/serve's flags (their argparse names) and ``Engine(**config)``'s keyword arguments are the
same settings under the same names: a setting named as a field of a config view
(:mod:`conveyor.runtime.config`) sets that field wherever it appears (``block_size`` in the
worker's and the scheduler's view, ``profile`` in every process's); the few whose name or unit
differs (``num_kv_blocks``, ``kv_cache_memory`` and ``swap_space`` in GiB, ``threads``) are
converted in one place, :func:`worker_settings`. So :func:`server_config` (bin/serve) and the
engine (:mod:`conveyor.engine`) build the worker's runner and the scheduler's config from the
same functions, with the defaults the config classes hold.

Imports neither torch nor any process's code: the engine and bin/serve both load it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.ipc import step_channel, transport
from conveyor.ipc.transport import ServerAddresses
from conveyor.runtime.config import (
    FrontendConfig,
    HttpConfig,
    PlanTransport,
    RunnerConfig,
    SchedulerConfig,
    SchedulerProcessConfig,
    ServerConfig,
    WorkerConfig,
    remote_plans_address,
)
from conveyor.runtime.model_source import draft_model_config, model_length, model_name, resolve_model
from conveyor.runtime.tensor_shards import check_shardable

T = TypeVar("T")

GIB = 1 << 30


def gib_bytes(gib: float) -> int:
    """``gib`` GiB (a size as the settings give it) in bytes (as the configs hold it)."""
    return int(gib * GIB)


def settings_view(view: type[T], settings: Mapping[str, Any], **fields: Any) -> T:
    """``view`` (a config dataclass) from the settings named as its fields, and ``fields``,
    which win over a setting of the same name (its value converted: a length resolved, GB/s
    to bytes/s, a pool sized)."""
    named = {f.name: settings[f.name] for f in dataclasses.fields(view) if f.name in settings}
    return view(**{**named, **fields})


def worker_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`WorkerConfig` and :class:`RunnerConfig` fields the settings give, by their
    field names: those named as fields as they are, the KV pool from ``num_kv_blocks`` or else ``kv_cache_memory`` GiB
    (exactly one of ``num_blocks`` and ``kv_cache_memory_bytes`` is set), the swap space from
    ``swap_space`` GiB (None: the device's default), torch's CPU threads from ``threads``, the
    verify width from ``num_speculative_tokens`` when ``speculative_method`` is set (else 0).
    The worker process's view is built from these (:func:`worker_config`), and so is the
    engine's runner."""
    names = {f.name for view in (WorkerConfig, RunnerConfig) for f in dataclasses.fields(view)}
    named = {name: settings[name] for name in names if name in settings}
    named["lora_modules"] = lora_modules(settings)
    named["enable_lora"] = bool(settings.get("enable_lora") or settings.get("enable_lora_loading"))
    blocks = settings.get("num_kv_blocks")
    swap = settings.get("swap_space")
    return {
        **named,
        "num_blocks": blocks,
        "kv_cache_memory_bytes": None if blocks is not None else gib_bytes(settings["kv_cache_memory"]),
        "swap_space_bytes": None if swap is None else gib_bytes(swap),
        "num_threads": settings.get("threads"),
        "num_speculative_tokens": settings.get("num_speculative_tokens", 0)
        if settings.get("speculative_method")
        else 0,
    }


def worker_config(settings: Mapping[str, Any], **fields: Any) -> WorkerConfig:
    """The worker process's view from :func:`worker_settings`' dict, with ``fields`` over it:
    the runner's fields in its :class:`RunnerConfig`, the process's beside it."""
    merged = {**settings, **fields}
    return settings_view(WorkerConfig, merged, runner=settings_view(RunnerConfig, merged))


def lora_modules(settings: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The ``lora_modules`` setting (a name -> directory map, or bin/serve's ``(name, dir)``
    pairs) as the configs hold it: ``(name, dir)`` pairs, each name once."""
    modules = settings.get("lora_modules") or {}
    pairs = list(modules.items()) if isinstance(modules, Mapping) else [tuple(pair) for pair in modules]
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"a LoRA adapter name is given twice in {names}")
    return tuple((str(name), str(directory)) for name, directory in pairs)


def batcher_config(settings: Mapping[str, Any], max_model_len: int, **fields: Any) -> SchedulerConfig:
    """The batcher's config from the settings (ValueError on a bad knob), with the least
    valid pool: the pool's fields are the worker's to tell once it has sized its KV cache
    (:meth:`ServerConfig.sized_scheduler`, or :func:`dataclasses.replace` in the engine)."""
    return settings_view(
        SchedulerConfig,
        settings,
        num_blocks=settings.get("num_kv_blocks") or 1,
        num_cpu_blocks=settings.get("num_cpu_blocks") or 0,
        max_model_len=max_model_len,
        lora_names=tuple(name for name, _ in lora_modules(settings)),
        **fields,
    )


def api_keys(flags: Mapping[str, Any]) -> tuple[str, ...]:
    """The HTTP face's API keys: ``api_key`` (a list), the lines of ``api_key_file`` (blank
    lines and ``#`` comments skipped), then $CONVEYOR_API_KEY and $VLLM_API_KEY; in that
    order, each once."""
    keys = list(flags.get("api_key") or ())
    if flags.get("api_key_file") is not None:
        for line in Path(flags["api_key_file"]).read_text().splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                keys.append(line.strip())
    for name in ("CONVEYOR_API_KEY", "VLLM_API_KEY"):
        if os.environ.get(name):
            keys.append(os.environ[name])
    return tuple(dict.fromkeys(keys))


def server_config(flags: Mapping[str, Any], run_dir: str) -> ServerConfig:
    """bin/serve's flags (by their argparse names) as one :class:`ServerConfig`; ValueError,
    OSError or StartupError when they do not make one. ``run_dir`` holds the internal sockets
    and plan rings. The scheduler's pool fields wait for the worker (ServerConfig.sized_scheduler)."""
    model_dir, demo = resolve_model(flags["model"])
    model = ModelConfig.from_dir(model_dir)
    if flags["auth_keys"] is not None:
        transport.check_auth_keys(flags["auth_keys"])
    if flags.get("cluster_key") is not None:
        transport.ClusterKey.load(flags["cluster_key"])  # a wrong file fails here, before any process starts
    max_model_len = model_length(model, flags["max_model_len"])
    if flags.get("speculative_model") is not None:  # (every rank runs its shard of the draft too)
        draft_model_config(flags["speculative_model"], model, max_model_len, flags["tensor_parallel_size"])
    addresses = ServerAddresses.in_run_dir(run_dir, transport.client_address(flags["host"], flags["port"]))
    nnodes, size = flags.get("nnodes", 1), flags["tensor_parallel_size"]
    multi_node = nnodes > 1 and flags.get("dist_init_addr") is not None and size % nnodes == 0  # else refused below
    channels = step_channel.StepChannels.for_server(
        run_dir,
        addresses.plans,
        addresses.results,
        shm=flags["plan_transport"] == PlanTransport.SHM,
        plan_readers=size,
        local_plan_readers=size // nnodes if multi_node else None,  # node 0's ranks
        remote_plans_address=remote_plans_address(flags["dist_init_addr"]) if multi_node else None,
        remote_plans_key=flags.get("cluster_key") if multi_node else None,
    )
    worker = worker_config(
        worker_settings(flags),
        model_dir=model_dir,
        addresses=addresses,
        channels=channels,
        pipeline=flags["pipeline_steps"],
    )
    frontend = settings_view(
        FrontendConfig,
        flags,
        model_dir=model_dir,
        addresses=addresses,
        max_model_len=max_model_len,
        vocab_size=model.vocab_size,
    )
    batcher = batcher_config(flags, max_model_len, swap_bandwidth=flags["swap_bandwidth"] * 1e9)
    scheduler = settings_view(
        SchedulerProcessConfig,
        flags,
        scheduler=batcher,
        addresses=addresses,
        channels=channels,
        eos_token_ids=list(model.eos_token_ids),
        vocab_size=model.vocab_size,
    )
    http = None
    if flags["http_port"] is not None or flags["metrics_port"] is not None:
        name = flags["served_model_name"] or model_name(model_dir, demo)
        http = settings_view(
            HttpConfig, flags, addresses=addresses, served_model_name=name, max_model_len=max_model_len,
            model_dir=str(model_dir), api_keys=api_keys(flags), lora_names=batcher.lora_names,
        )  # fmt: skip
    config = ServerConfig(
        model_dir, demo, run_dir, addresses, channels, frontend, worker, scheduler, http,
        serve_on_replica_death=flags["serve_on_replica_death"],
        nnodes=flags.get("nnodes", 1), node_rank=flags.get("node_rank", 0), dist_init_addr=flags.get("dist_init_addr"),
        cluster_key=flags.get("cluster_key"), insecure_cluster=flags.get("insecure_cluster", False),
    )  # fmt: skip
    # Every rank runs its shard of the model (checked once the flags made a configuration, so
    # that a size the nodes cannot share is reported as such first).
    check_shardable(model, size, f"--model {model_dir}", flags.get("expert_parallel", False))
    return config
