"""The HTTP process's configuration (:class:`HttpConfig`), a view of the server's like the
others in :mod:`conveyor.runtime.config` (which re-exports it): what the OpenAI-compatible API
and the metrics listener serve, their keys and TLS, and their bounds on clients."""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.ipc.transport import ServerAddresses
from conveyor.runtime.config_fields import require_at_least


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP process's view: the OpenAI-compatible API on ``http_port`` and/or the
    Prometheus scrape endpoint on ``metrics_port``, both on ``http_host``.

    The HTTP process is a client of the frontend over the client protocol (``addresses.client``);
    it validates nothing the frontend validates. With only ``metrics_port`` it serves
    ``/metrics`` and ``/health`` alone. Port 0 binds a free port (reported when ready).
    """

    addresses: ServerAddresses
    served_model_name: str  # the base model's name: the ``model`` requests name for it
    max_model_len: int  # shown by /v1/models
    lora_names: tuple[str, ...] = ()  # LoRA adapters, the other models requests may name
    http_host: str = "127.0.0.1"
    http_port: int | None = None
    metrics_port: int | None = None
    # bin/serve --auth-keys: the HTTP process is a client of the frontend and connects with
    # the server's own key pair from this directory (the frontend allows it).
    auth_keys: str | None = None
    # The model directory: its tokenizer serves /tokenize, /detokenize and the fields that need
    # the prompt's tokens (conveyor.http.tokens), loaded on first use.
    model_dir: str | None = None
    # --api-key / --api-key-file / $CONVEYOR_API_KEY: the keys clients send as
    # ``Authorization: Bearer``; empty: no key needed. ``api_key_everywhere``: /health,
    # /metrics and /version need one too.
    api_keys: tuple[str, ...] = ()
    api_key_everywhere: bool = False
    # --tool-call-parser: how a chat's output with tools is read for calls (hermes, llama3;
    # conveyor.structured.tool_calls); None: not parsed (tools still reach the chat template,
    # and a forcing tool_choice is still read from its constrained JSON).
    tool_call_parser: str | None = None
    # --reasoning-parser: how an answer's think block is split off as reasoning (qwen3,
    # deepseek_r1; conveyor.structured.reasoning); None: the answer is all content.
    reasoning_parser: str | None = None
    # --strict-fields: a request field no schema knows is a 400 (default: ignored, reported in
    # the x-conveyor-ignored-fields header and a warning, as vLLM does).
    strict_fields: bool = False
    # --ssl-certfile / --ssl-keyfile: serve HTTPS (both or neither).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # One HTTP request may ask for a quarter of --max-waiting sequences (0: no bound); slow
    # clients' bounds (conveyor.http.connections).
    max_waiting: int = 4096
    http_header_timeout: float = 10.0
    http_body_timeout: float = 30.0
    http_max_connections: int = 2048

    def __post_init__(self) -> None:
        require_at_least(self, 1e-3, "http_header_timeout", "http_body_timeout")
        require_at_least(self, 1, "http_max_connections")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("--ssl-certfile and --ssl-keyfile go together")
        if any(not k or k != k.strip() or any(c.isspace() for c in k) for k in self.api_keys):
            raise ValueError("an API key must be non-empty and hold no whitespace")
        if self.http_port is None and self.metrics_port is None:
            raise ValueError("the HTTP process needs http_port or metrics_port")
        for name in ("http_port", "metrics_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.http_port is not None and self.http_port == self.metrics_port and self.http_port != 0:
            raise ValueError(
                f"http_port and metrics_port are both {self.http_port}: /metrics is on the HTTP port already"
            )
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
