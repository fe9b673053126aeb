"""bin/serve's checks before any process starts: mistakes found here cost no model load.

Each check is one a user makes by hand and would otherwise learn of only from a child
process's failure, seconds to minutes later (a tokenizer or a port in use after the
frontend started, a missing GPU after the worker imported torch, an adapter's rank after the
weights loaded). Each raises :class:`StartupError` with one line naming the flag and what
to do, and each asks exactly what the process that would fail asks, through the same rule:
the tokenizer file (:func:`conveyor.frontend.tokenizer_files.tokenizer_file`), an adapter's
config (:func:`conveyor.worker.lora_config.read_adapter_config`), the TLS files
(:func:`conveyor.http.main.ssl_context`), a listening port (a bind, as ZeroMQ and aiohttp bind). The
device is asked of the CUDA driver, which is what torch asks too, without importing torch (seconds)
into bin/serve. The processes still check again: a port can be taken between the check and the bind.
"""

from __future__ import annotations

import ctypes
import json
import socket
import ssl
from pathlib import Path

from conveyor.frontend.tokenizer_files import tokenizer_file
from conveyor.runtime.config import ServerConfig
from conveyor.runtime.model_source import StartupError
from conveyor.structured.reasoning import CLOSE, OPEN
from conveyor.worker.lora_config import LoraLoadError, read_adapter_config


def check_before_start(config: ServerConfig) -> None:
    """Refuse ``config`` (StartupError) for the mistakes found without loading the model."""
    if config.node_rank == 0:  # the node that runs the frontend and the HTTP face
        try:
            tokenizer = tokenizer_file(Path(config.model_dir))
        except FileNotFoundError as exc:
            raise StartupError(f"--model {config.model_dir}: {exc}") from None
        if config.http is not None and config.http.reasoning_parser is not None:
            check_think_tokens(tokenizer, config.http.reasoning_parser)
        client = config.addresses.client
        if client.startswith("tcp://"):
            host, _, port = client.removeprefix("tcp://").rpartition(":")
            check_port_free("--port", host, port, ipv4_first=True)  # ZeroMQ binds IPv4 unless told otherwise
        if config.http is not None:
            for flag, port in (("--http-port", config.http.http_port), ("--metrics-port", config.http.metrics_port)):
                if port:
                    check_port_free(flag, config.http.http_host, str(port))
            if config.http.ssl_certfile is not None:
                from conveyor.http.main import ssl_context  # aiohttp's import, only when TLS is asked for

                try:
                    ssl_context(config.http.ssl_certfile, config.http.ssl_keyfile)  # type: ignore[arg-type]
                except (OSError, ssl.SSLError) as exc:
                    raise StartupError(f"--ssl-certfile/--ssl-keyfile: cannot load them: {exc}") from None
    device = str(config.worker.runner.device)
    if device.startswith("cuda") and cuda_device_count() == 0:
        raise StartupError(f"--device {device}: no CUDA device is visible here; use --device cpu (or auto)")
    for name, directory in config.worker.runner.lora_modules:
        try:
            read_adapter_config(name, directory, config.worker.runner.max_lora_rank)
        except LoraLoadError as exc:
            raise StartupError(f"--lora-modules {name}={directory}: {exc}") from None


def check_think_tokens(tokenizer: Path, parser: str) -> None:
    """``--reasoning-parser`` needs the think block's tags as single tokens of the tokenizer
    (Qwen3's and DeepSeek-R1's added tokens): the usage's reasoning tokens and the reasoning
    budget are counted and written by those ids, so a tokenizer without them is refused, as vLLM does."""
    try:
        spec = json.loads(tokenizer.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StartupError(f"--model: cannot read {tokenizer}: {exc}") from None
    vocab = (spec.get("model") or {}).get("vocab")
    tokens = {t.get("content") for t in spec.get("added_tokens") or ()}
    tokens.update(vocab if isinstance(vocab, dict) else (v[0] for v in vocab or () if isinstance(v, list) and v))
    missing = [tag for tag in (OPEN, CLOSE) if tag not in tokens]
    if missing:
        raise StartupError(
            f"--reasoning-parser {parser}: this model's tokenizer has no {' and no '.join(missing)} token, so its "
            "answers have no think block to split; leave the flag out for this model"
        )


def check_port_free(flag: str, host: str, port: str, *, ipv4_first: bool = False) -> None:
    """StartupError naming ``flag`` when ``host:port`` cannot be bound because something
    listens there, probed on the address the listener would take: the first ``host``
    resolves to (the HTTP listeners), or its first IPv4 one (``ipv4_first``: ZeroMQ). A host
    that does not resolve or a port that is not a number is left to the process that binds
    it (its own error names the address)."""
    if not port.isdigit() or int(port) == 0:
        return
    host = "" if host in ("*", "") else host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return
    if ipv4_first:
        infos = sorted(infos, key=lambda info: info[0] != socket.AF_INET)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ and aiohttp bind
        try:
            probe.bind(address)
        except OSError as exc:
            raise StartupError(
                f"{flag} {port}: {host or '*'}:{port} is already in use ({exc.strerror}); "
                f"stop what listens there or pick another {flag}"
            ) from None


CUDA_ERROR_NO_DEVICE = 100  # cuInit's answer where the driver runs and sees no GPU


def cuda_device_count() -> int | None:
    """CUDA devices the driver shows this process (CUDA_VISIBLE_DEVICES applies): 0 without a
    driver or where it sees none; None where it cannot tell (another driver error: left to the
    worker, whose torch then says why). torch.cuda.is_available() asks the same driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    status = cuda.cuInit(0)
    if status == CUDA_ERROR_NO_DEVICE:
        return 0
    count = ctypes.c_int(0)
    if status != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    return count.value
