"""The ``metrics`` message of the client protocol: its validation, its reply map, and the
clients' ``metrics()`` (routed by the reply's type, beside ``stats``)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from conveyor.client import AsyncClient, Client
from conveyor.frontend.request_metrics import FrontendMetrics
from conveyor.protocol import replies, wire
from conveyor.protocol import requests as client_requests
from tests.protocol.stand_in import RouterStandIn


def test_metrics_parses_and_names_bad_fields() -> None:
    assert client_requests.parse_client_message({"type": "metrics", "v": 1}) == client_requests.MetricsCommand()
    assert client_requests.parse_client_message({"type": "metrics"}) == client_requests.MetricsCommand()
    with pytest.raises(wire.ProtocolError, match="unknown field.*window_s"):
        client_requests.parse_client_message({"type": "metrics", "v": 1, "window_s": 5})
    with pytest.raises(wire.ProtocolError, match="protocol version"):
        client_requests.parse_client_message({"type": "metrics", "v": 2})


def test_metrics_reply_carries_counters_and_histograms() -> None:
    snapshot = FrontendMetrics().snapshot()
    reply = replies.metrics_reply(**snapshot)
    assert reply == {"type": "metrics", "v": wire.CLIENT_PROTOCOL_VERSION, **snapshot}
    assert msgpack.unpackb(wire.pack(reply)) == reply  # plain msgpack types only


class MetricsStandIn(RouterStandIn):
    """Answers ``metrics`` with a fixed map, and anything else with the stats map."""

    METRICS = replies.metrics_reply(**FrontendMetrics().snapshot())

    def answer(self, msg: dict) -> dict | None:
        return self.METRICS if msg["type"] == wire.METRICS else self.STATS


def test_clients_ask_for_metrics(tmp_path) -> None:
    address = f"ipc://{tmp_path}/metrics"
    server = MetricsStandIn(address, expect=4)
    try:
        with Client(address, connect_timeout=5.0) as client:
            assert client.metrics() == MetricsStandIn.METRICS
            assert client.stats() == MetricsStandIn.STATS

        async def both() -> tuple[dict, dict]:
            async with AsyncClient(address, connect_timeout=5.0) as aclient:
                return await asyncio.gather(aclient.metrics(), aclient.stats())

        got_metrics, got_stats = asyncio.run(both())
    finally:
        server.close()
    assert (got_metrics, got_stats) == (MetricsStandIn.METRICS, MetricsStandIn.STATS)
    assert server.received[0] == {"type": wire.METRICS, "v": wire.CLIENT_PROTOCOL_VERSION}
