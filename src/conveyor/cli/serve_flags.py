"""bin/serve's flag groups: LoRA, the HTTP face, scheduling, and the small argument types
they share; :mod:`conveyor.cli.serve` builds the parser from them."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from conveyor.runtime.config import (
    Choice,
    FrontendConfig,
    HttpConfig,
    RunnerConfig,
    SchedulerConfig,
)


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
    count_flag(
        g, "--max-loras", SchedulerConfig.max_loras, "adapters on the device at once (distinct adapters in one step)"
    )
    count_flag(g, "--max-lora-rank", RunnerConfig.max_lora_rank, "largest adapter rank accepted")
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


def add_rl_arguments(p: argparse.ArgumentParser) -> None:
    """Weight updates, sleep and wake, pause and continue (docs/rl.md)."""
    g = p.add_argument_group("RL rollouts")
    g.add_argument(
        "--enable-rl-control",
        action="store_true",
        help="let clients update the weights, sleep, wake, pause and resume (update_weights, /sleep, ...); off: an "
        "update reads any directory the client names",
    )
    g.add_argument(
        "--asleep-requests",
        default="wait",
        choices=("wait", "refuse"),
        help="requests that arrive while the server sleeps wait for the wake, or are refused at once",
    )


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR, got {text!r}")
    return name, directory


def choice_flag(p: argparse._ActionsContainer, flag: str, default: Choice, help: str | None = None) -> None:
    """A flag that picks a mode: its choices are the names of ``default``'s enum, so a mode
    added to the enum is a value of the flag at once, and the default is the config's own."""
    p.add_argument(flag, default=default, choices=type(default).names(), help=help)


def count_flag(p: argparse._ActionsContainer, flag: str, default: int, help: str, *, minimum: int = 1) -> None:
    """A whole-number flag with a lower bound (a size, a rank, a queue length) whose default is the config's own."""
    p.add_argument(flag, type=_at_least(minimum), default=default, help=help)


def switch_flag(p: argparse._ActionsContainer, flag: str, default: bool, help: str) -> None:
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
    switch_flag(
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
    switch_flag(
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
    choice_flag(g, "--policy", SchedulerConfig.policy, "order of the waiting line")
    g.add_argument(
        "--aging-rate",
        type=float,
        default=SchedulerConfig.aging_rate,
        help="priority points a waiting request gains per second",
    )
    choice_flag(
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
    switch_flag(
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
