"""The Prometheus text exposition of a Conveyor server: ``GET /metrics``.

Two sources, both read over the client protocol: the frontend's ``metrics`` reply (request-level
counters and latency histograms, :mod:`conveyor.frontend.metrics`) and the scheduler's ``stats``
reply (queues, KV blocks, prefix cache, preemptions). :func:`exposition` renders one scrape from
them with ``prometheus_client``: a fresh :class:`~prometheus_client.CollectorRegistry` per call
with one collector yielding metric families built from the two maps, so nothing here keeps
state between scrapes and the values are exactly what the server reported.

Names follow what operators know from vLLM, under the ``conveyor:`` prefix with the same
suffixes (Prometheus names may contain ``:``); counters get ``_total`` from
``prometheus_client``. Histograms are in seconds and their ``le`` buckets are cumulative, as
Prometheus wants (the ``metrics`` reply's counts are per bucket and are summed up here).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

PREFIX = "conveyor:"
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
)
# metrics reply counter -> help
_COUNTER_HELP = {
    "prompt_tokens": "Prompt tokens sent to the scheduler (a continuation's earlier turns included).",
    "generation_tokens": "Output tokens delivered to requests.",
}
# metrics reply histogram -> help
_HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Time from a request's arrival to its first token.",
    "time_per_output_token_seconds": "(end-to-end - time to first token) / (output tokens - 1), per request.",
    "inter_token_latency_seconds": "Gap between consecutive output tokens of a stream as delivered.",
    "e2e_request_latency_seconds": "Time from a request's arrival to its final.",
    "request_queue_time_seconds": "Time from a request's arrival to its first scheduling.",
}


def exposition(metrics: dict[str, Any], stats: dict[str, Any] | None) -> bytes:
    """One scrape in the Prometheus text format from a ``metrics`` reply and a ``stats`` reply
    (``Client.metrics()``, ``Client.stats()``). ``stats`` None (the scheduler did not answer)
    leaves the scheduler's families out; the frontend's are still there."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(metrics, stats))
    return generate_latest(registry)


class _Snapshot:
    """A collector over one pair of replies (the registry asks it once, in ``generate_latest``)."""

    def __init__(self, metrics: dict[str, Any], stats: dict[str, Any] | None) -> None:
        self._metrics = metrics
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        if self._stats is not None:
            yield from _scheduler_families(self._stats)
        yield from _frontend_families(self._metrics)


def _scheduler_families(stats: dict[str, Any]) -> Iterator[Metric]:
    for field, name, doc in _STATS_GAUGES:
        yield GaugeMetricFamily(PREFIX + name, doc, value=stats[field])
    total = stats["total_blocks"]
    yield GaugeMetricFamily(
        PREFIX + "kv_cache_usage_perc",
        "Fraction of KV cache blocks held by requests (0 to 1; cached prefixes count as free).",
        value=stats["held_blocks"] / total if total else 0.0,
    )
    for field, name, doc in _STATS_COUNTERS:
        yield CounterMetricFamily(PREFIX + name, doc, value=stats[field])
    preemptions = CounterMetricFamily(
        PREFIX + "num_preemptions", "Requests preempted, by kind (swap to CPU, or recompute).", labels=["kind"]
    )
    preemptions.add_metric(["swap"], stats["num_preemptions_swap"])
    preemptions.add_metric(["recompute"], stats["num_preemptions_recompute"])
    yield preemptions
    yield from _replica_families(stats.get("replicas", ()))


def _replica_families(replicas: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per data-parallel replica (``stats``' ``replicas``; the families above are their sums):
    whether it is alive, the requests it holds and has been sent, and its KV cache usage."""
    up = GaugeMetricFamily(PREFIX + "replica_up", "1 while the data-parallel replica serves, 0 once it died.", labels=["replica"])
    in_flight = GaugeMetricFamily(
        PREFIX + "replica_requests_in_flight", "Requests the replica holds (sent, not finished).", labels=["replica"]
    )
    routed = CounterMetricFamily(PREFIX + "replica_requests_routed", "Requests sent to the replica.", labels=["replica"])
    usage = GaugeMetricFamily(
        PREFIX + "replica_kv_cache_usage_perc", "Fraction of the replica's KV cache blocks held by requests.", labels=["replica"]
    )
    for replica in replicas:
        label = [str(replica["replica"])]
        up.add_metric(label, 1 if replica["alive"] else 0)
        in_flight.add_metric(label, replica["in_flight"])
        routed.add_metric(label, replica["routed"])
        if replica.get("total_blocks"):
            usage.add_metric(label, replica["held_blocks"] / replica["total_blocks"])
    if replicas:
        yield from (up, in_flight, routed, usage)


def _frontend_families(metrics: dict[str, Any]) -> Iterator[Metric]:
    counters = metrics["counters"]
    for name, doc in _COUNTER_HELP.items():
        yield CounterMetricFamily(PREFIX + name, doc, value=counters[name])
    success = CounterMetricFamily(
        PREFIX + "request_success", "Requests that ended, by finish reason.", labels=["finished_reason"]
    )
    for reason, count in sorted(counters["request_success"].items()):
        success.add_metric([reason], count)
    yield success
    for name, hist in metrics["histograms"].items():
        cumulative, buckets = 0, []
        for bound, count in zip(hist["buckets"], hist["counts"]):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        buckets.append(("+Inf", hist["count"]))
        yield HistogramMetricFamily(
            PREFIX + name, _HISTOGRAM_HELP.get(name, name), buckets=buckets, sum_value=hist["sum"]
        )
