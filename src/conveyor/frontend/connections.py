"""The frontend's connection bookkeeping: which connection holds which routing id, and the
requests of a connection that can receive nothing more (disconnected, taken over, not
reading) dropped: untracked, counted as aborts, aborted at the scheduler, with no final."""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from conveyor.frontend.request_metrics import FrontendMetrics
from conveyor.frontend.request_state import RequestState
from conveyor.frontend.shares import ClientShares
from conveyor.ipc.messages import FinishReason

log = logging.getLogger("conveyor.frontend")


class ClientConnections:
    """The connection bookkeeping of the frontend (module docstring), over its table of requests
    in flight (``in_flight``, by key); ``untrack`` and ``abort`` are the frontend's: forget a
    request, abort scheduler ids at their replicas. ``send_queue``: --client-send-queue (logged)."""

    def __init__(
        self,
        in_flight: dict[tuple[bytes, str], RequestState],
        metrics: FrontendMetrics,
        shares: ClientShares,
        untrack: Callable[[RequestState], None],
        abort: Callable[[list[str]], None],
        send_queue: int,
    ) -> None:
        self.in_flight = in_flight
        self.metrics = metrics
        self.shares = shares
        self._untrack = untrack
        self._abort_at_scheduler = abort
        self.send_queue = send_queue
        # fd -> routing id of each open connection that has sent a message: which connection
        # holds a routing id now (note), so a takeover drops the old one's requests.
        self._connections: dict[int, bytes] = {}

    async def on_monitor_event(self, frames) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self.gone(event["value"], "disconnected")

    def note(self, identity: bytes, fd: int) -> None:
        """Record that the connection on ``fd`` holds routing id ``identity``; if it is the first
        message of a connection that took ``identity`` over from another (ROUTER_HANDOVER), that
        other connection is gone for every purpose of ours.

        libzmq reports nothing on a takeover: the old connection's pipe is terminated, but its
        TCP/ipc connection stays open, answers heartbeats and gets no DISCONNECTED event until
        its client closes it (or sends a message, which libzmq then never reads, so the
        heartbeat drops it ~10 s later). Nothing it sent before can be answered any more: every
        reply under ``identity`` goes to the new connection. The one sign the frontend gets is a
        message under ``identity`` from a new fd, which can only come once the new connection
        holds the routing id; its requests are then aborted like a disconnect's, before this
        message is handled (so a ``generate`` under an id the old connection had in flight is
        the new connection's own request, not a duplicate). A disconnect of ``fd`` is always
        handled before a later connection's first message on the same fd
        (the intake's ``_on_client_frames``), so ``fd`` is never mistaken for the connection before it."""
        if self._connections.get(fd) == identity:
            return  # the common case: one dict lookup per message
        for old_fd in [f for f, held in self._connections.items() if held == identity]:
            self.gone(old_fd, "taken over by a new connection under its routing id")
        self._connections[fd] = identity

    def gone(self, fd: int, why: str) -> None:
        """The connection on ``fd`` can receive nothing more (it disconnected, a newer
        connection took its routing id over, or it stopped reading its replies): drop the
        requests it sent, and only those; a newer connection under the same routing id may have
        requests in flight of its own."""
        self._connections.pop(fd, None)
        self.shares.forget(fd)
        victims = [s for s in self.in_flight.values() if s.fd == fd]
        if victims:
            log.info("client connection %s; aborting %d request(s)", why, len(victims))
            self.drop(victims)

    def drop(self, states: list[RequestState]) -> None:
        """Untrack the requests of a client that is gone (no final) and abort those the scheduler has."""
        for state in states:
            self._untrack(state)
            self.metrics.request_finished(
                FinishReason.ABORT, None, len(state.token_ids), state.prompt_len, state.max_tokens
            )
        admitted = [s.scheduler_id for s in states if not s.pending]
        if admitted:
            self._abort_at_scheduler(admitted)

    def not_reading(self, identity: bytes) -> None:
        """A send to ``identity`` found its connection's send queue full (``--client-send-queue``
        replies waiting, and the socket buffers behind them): the client has stopped reading,
        and every reply it is sent from now on would be held here for as long as its requests
        run. Its connection is treated as gone (:meth:`gone`: its requests are
        aborted and their KV blocks freed; no final, which could not be queued either) and
        counted. The connection that holds ``identity`` is the one whose queue is full (one
        connection per routing id, :meth:`note`); none holds it when this
        connection was dropped already, by an earlier send of the same pass: nothing to do."""
        fd = next((f for f, held in self._connections.items() if held == identity), None)
        if fd is None:
            return
        self.metrics.clients_not_reading += 1
        log.warning(
            "client connection %s is not reading its replies (send queue of %d full); dropping its requests",
            identity.hex(),
            self.send_queue,
        )
        self.gone(fd, "not reading its replies")

    def client_gone(self, identity: bytes) -> None:
        """A send found the client gone: abort its in-flight requests."""
        victims = [s for s in self.in_flight.values() if s.identity == identity]
        if victims:
            log.info("client gone; aborting %d request(s)", len(victims))
            self.drop(victims)
