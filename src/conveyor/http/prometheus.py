"""The Prometheus text exposition of a Conveyor server: ``GET /metrics``.

Two sources, both read over the client protocol: the frontend's ``metrics`` reply (request-level
counters and latency histograms, :mod:`conveyor.frontend.request_metrics`) and the scheduler's ``stats``
reply (queues, KV blocks, prefix cache, preemptions, speculative decoding). :func:`exposition` renders one scrape from
them with ``prometheus_client``: a fresh :class:`~prometheus_client.CollectorRegistry` per call
with one collector yielding metric families built from the two maps, so nothing here keeps
state between scrapes and the values are exactly what the server reported.

Names follow what operators know from vLLM, under the ``conveyor:`` prefix with the same
suffixes (Prometheus names may contain ``:``); counters get ``_total`` from
``prometheus_client``. Every series carries ``model_name`` (the served model name), as
vLLM's do. The families vLLM also has are exported a second time under vLLM's own names
(:data:`VLLM_NAMES`: ``vllm:`` + the same suffix; vLLM's total ``num_preemptions`` and its
older ``gpu_cache_usage_perc`` beside), so a dashboard or alert written for vLLM reads a
Conveyor server unchanged; Conveyor's own dashboard (docs/grafana/conveyor.json) uses the
``conveyor:`` names. Time histograms are in seconds, token histograms in tokens; their
``le`` buckets are cumulative, as Prometheus wants (the replies' counts are per bucket and
are summed up here).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from conveyor.ipc.messages import ITERATION_TOKEN_BUCKETS

PREFIX = "conveyor:"
VLLM_PREFIX = "vllm:"
# Families exported under vLLM's names too (the suffix after the prefix is the same).
VLLM_NAMES = frozenset(
    {
        "num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
        "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens", "request_success",
        "time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
        "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
        "request_decode_time_seconds", "request_inference_time_seconds", "request_prompt_tokens",
        "request_generation_tokens", "request_params_max_tokens", "iteration_tokens_total",
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
    }
)  # fmt: skip
# The Content-Type to serve a scrape with: the classic text format, which every Prometheus
# reads. Our names are all legacy-valid ([a-zA-Z_:][a-zA-Z0-9_:]*), so generate_latest's
# output is that format in every prometheus_client version (newer ones name it 1.0.0).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# stats field -> (gauge name, help)
_STATS_GAUGES = (
    ("num_running", "num_requests_running", "Requests in the running batch (prefilling or decoding)."),
    ("num_waiting", "num_requests_waiting", "Requests in the waiting queue (preempted and swapped ones included)."),
    ("num_swapped", "num_requests_swapped", "Waiting requests preempted by swap, their KV blocks in CPU memory."),
    ("held_blocks", "kv_blocks_used", "KV cache blocks held by requests."),
    ("free_blocks", "kv_blocks_free", "KV cache blocks free (neither held nor caching a prefix)."),
    ("cached_blocks", "kv_blocks_cached", "KV cache blocks holding a reusable prefix, held by no request."),
)
# stats field -> (counter name, help)
_STATS_COUNTERS = (
    ("prefix_cache_queried_tokens", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hit_tokens", "prefix_cache_hits", "Prompt tokens whose KV the prefix cache supplied."),
    ("spec_num_proposals", "spec_decode_num_drafts", "Speculative proposals verified (one per decode row and step)."),
    ("spec_proposed_tokens", "spec_decode_num_draft_tokens", "Speculative tokens proposed and verified."),
    ("spec_accepted_tokens", "spec_decode_num_accepted_tokens", "Speculative tokens accepted."),
    ("spec_num_steps", "spec_decode_num_steps", "Steps that verified at least one speculative proposal."),
    (
        "spec_num_limited_steps",
        "spec_decode_num_limited_steps",
        "Steps kept from proposing by the batch-size rule (--speculative-max-batch).",
    ),
)
# metrics reply counter -> help
_COUNTER_HELP = {
    "prompt_tokens": "Prompt tokens sent to the scheduler (a continuation's earlier turns included).",
    "generation_tokens": "Output tokens delivered to requests.",
    "clients_not_reading": "Client connections dropped because their send queue filled (they stopped reading).",
}
# metrics reply histogram -> help
_HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Time from a request's arrival to its first token.",
    "time_per_output_token_seconds": "(end-to-end - time to first token) / (output tokens - 1), per request.",
    "inter_token_latency_seconds": "Gap between consecutive output tokens of a stream as delivered.",
    "e2e_request_latency_seconds": "Time from a request's arrival to its final.",
    "request_queue_time_seconds": "Time from a request's arrival to its first scheduling.",
    "request_prefill_time_seconds": "Time from a request's first scheduling to its first token.",
    "request_decode_time_seconds": "Time from a request's first token to its final.",
    "request_inference_time_seconds": "Time from a request's first scheduling to its final.",
    "request_prompt_tokens": "Prompt tokens of each finished request (its whole context).",
    "request_generation_tokens": "Output tokens of each finished request.",
    "request_params_max_tokens": "The max_tokens each finished request ran with.",
}


def exposition(
    metrics: dict[str, Any], stats: dict[str, Any] | None, model_name: str, http: dict[str, Any] | None = None
) -> bytes:
    """One scrape in the Prometheus text format from a ``metrics`` reply and a ``stats`` reply
    (``Client.metrics()``, ``Client.stats()``), every series labelled ``model_name``.
    ``stats`` None (the scheduler did not answer) leaves the scheduler's families out; the
    frontend's are still there. ``http``: the HTTP process's own connection counts
    (:meth:`conveyor.http.connections.Counts.snapshot`), when it has listeners."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(metrics, stats, model_name))
    if http is not None:
        registry.register(_HttpConnections(http, model_name))
    return generate_latest(registry)


class _HttpConnections:
    """The HTTP listeners' open connections and the ones closed or refused, by cause."""

    def __init__(self, counts: dict[str, Any], model_name: str) -> None:
        self._counts, self._model = counts, model_name

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            PREFIX + "http_connections_open", "Open client connections of the HTTP listeners.", labels=["model_name"]
        )
        gauge.add_metric([self._model], self._counts["open"])
        yield gauge
        closed = CounterMetricFamily(
            PREFIX + "http_connections_closed",
            "HTTP connections the server closed or refused: header_timeout, idle_timeout, body_timeout (408), "
            "refused (503 at the cap).",
            labels=["model_name", "cause"],
        )
        for cause, count in sorted(self._counts["closed"].items()):
            closed.add_metric([self._model, cause], count)
        yield closed


class _Snapshot:
    """A collector over one pair of replies (the registry asks it once, in ``generate_latest``)."""

    def __init__(self, metrics: dict[str, Any], stats: dict[str, Any] | None, model_name: str) -> None:
        self._metrics = metrics
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        families = list(_frontend_families(self._metrics, self._model))
        if self._stats is not None:
            families[:0] = _scheduler_families(self._stats, self._model)
        yield from families
        for family in families:
            suffix = family.name[len(PREFIX) :]
            if suffix in VLLM_NAMES:
                yield _renamed(family, VLLM_PREFIX + suffix)
        if self._stats is not None:
            yield from _vllm_only(self._stats, self._model)


def _renamed(family: Metric, name: str) -> Metric:
    """``family`` under ``name``: the same samples, each sample's name prefix swapped."""
    copy = Metric(name, family.documentation, family.type)
    copy.samples = [sample._replace(name=name + sample.name[len(family.name) :]) for sample in family.samples]
    return copy


def _vllm_only(stats: dict[str, Any], model: str) -> Iterator[Metric]:
    """vLLM's names with no ``conveyor:`` family of their own: the total preemptions (ours
    are by kind) and the KV cache usage under its older name."""
    total = CounterMetricFamily(VLLM_PREFIX + "num_preemptions", "Requests preempted.", labels=["model_name"])
    total.add_metric([model], stats["num_preemptions_swap"] + stats["num_preemptions_recompute"])
    yield total
    yield _gauge(
        VLLM_PREFIX + "gpu_cache_usage_perc", "Fraction of KV cache blocks held by requests.", model, _usage(stats)
    )


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


def _usage(stats: dict[str, Any]) -> float:
    total = stats["total_blocks"]
    return stats["held_blocks"] / total if total else 0.0


def _histogram(name: str, doc: str, model: str, bounds: Any, counts: Any, total: float) -> HistogramMetricFamily:
    """A histogram from per-bucket counts (the last above every bound)."""
    cumulative, buckets = 0, []
    for bound, count in zip(bounds, counts):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    buckets.append(("+Inf", sum(counts)))
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], buckets, sum_value=total)
    return family


def _scheduler_families(stats: dict[str, Any], model: str) -> Iterator[Metric]:
    for field, name, doc in _STATS_GAUGES:
        yield _gauge(PREFIX + name, doc, model, stats[field])
    yield _gauge(
        PREFIX + "kv_cache_usage_perc",
        "Fraction of KV cache blocks held by requests (0 to 1; cached prefixes count as free).",
        model,
        _usage(stats),
    )
    for field, name, doc in _STATS_COUNTERS:
        yield _counter(PREFIX + name, doc, model, stats[field])
    preemptions = CounterMetricFamily(
        PREFIX + "num_preemptions",
        "Requests preempted, by kind (swap to CPU, or recompute).",
        labels=["model_name", "kind"],
    )
    preemptions.add_metric([model, "swap"], stats["num_preemptions_swap"])
    preemptions.add_metric([model, "recompute"], stats["num_preemptions_recompute"])
    yield preemptions
    per_position = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Speculative proposals whose tokens up to this position (0-based) were all accepted.",
        labels=["model_name", "position"],
    )
    for position, count in enumerate(stats.get("spec_accepted_per_position", ())):
        per_position.add_metric([model, str(position)], count)
    yield per_position
    if stats.get("iteration_token_counts"):
        yield _histogram(
            PREFIX + "iteration_tokens_total", "Tokens run by each iteration (prefill and decode together).", model,
            ITERATION_TOKEN_BUCKETS, stats["iteration_token_counts"], stats["iteration_token_sum"],
        )  # fmt: skip
    yield from _replica_families(stats.get("replicas", ()), model)


def _replica_families(replicas: list[dict[str, Any]], model: str) -> Iterator[Metric]:
    """Per data-parallel replica (``stats``' ``replicas``; the families above are their sums):
    whether it is alive, the requests it holds and has been sent, and its KV cache usage."""
    labels = ["model_name", "replica"]
    up = GaugeMetricFamily(
        PREFIX + "replica_up", "1 while the data-parallel replica serves, 0 once it died.", labels=labels
    )
    in_flight = GaugeMetricFamily(
        PREFIX + "replica_requests_in_flight", "Requests the replica holds (sent, not finished).", labels=labels
    )
    routed = CounterMetricFamily(PREFIX + "replica_requests_routed", "Requests sent to the replica.", labels=labels)
    usage = GaugeMetricFamily(
        PREFIX + "replica_kv_cache_usage_perc",
        "Fraction of the replica's KV cache blocks held by requests.",
        labels=labels,
    )
    for replica in replicas:
        label = [model, str(replica["replica"])]
        up.add_metric(label, 1 if replica["alive"] else 0)
        in_flight.add_metric(label, replica["in_flight"])
        routed.add_metric(label, replica["routed"])
        if replica.get("total_blocks"):
            usage.add_metric(label, replica["held_blocks"] / replica["total_blocks"])
    if replicas:
        yield from (up, in_flight, routed, usage)


def _frontend_families(metrics: dict[str, Any], model: str) -> Iterator[Metric]:
    counters = metrics["counters"]
    for name, doc in _COUNTER_HELP.items():
        yield _counter(PREFIX + name, doc, model, counters[name])
    success = CounterMetricFamily(
        PREFIX + "request_success", "Requests that ended, by finish reason.", labels=["model_name", "finished_reason"]
    )
    for reason, count in sorted(counters["request_success"].items()):
        success.add_metric([model, reason], count)
    yield success
    for name, hist in metrics["histograms"].items():
        yield _histogram(
            PREFIX + name, _HISTOGRAM_HELP.get(name, name), model, hist["buckets"], hist["counts"], hist["sum"]
        )
