"""Per-client shares of the waiting queue on the ZeroMQ face: one client's sequences in flight
(each request's prompts x ``n``, or ``best_of``) are at most a quarter of ``--max-waiting``, so
no client can fill the queue and starve the others (docs/reliability.md). The HTTP process's
connection (the internal endpoint) is exempt: it bounds each HTTP request's share itself."""

from __future__ import annotations

import socket

from conveyor.protocol import wire

# A client may hold this fraction of --max-waiting in sequences in flight.
SHARE_DIVISOR = 4


class ClientShares:
    """Sequences in flight per client key. ``max_waiting`` 0: no bound. ``internal``: the
    internal endpoint's ipc address (its connections are exempt)."""

    def __init__(self, max_waiting: int, internal: str) -> None:
        self.share = max_waiting // SHARE_DIVISOR if max_waiting else 0
        self.max_waiting = max_waiting
        self._internal_path = internal.removeprefix("ipc://") if internal.startswith("ipc://") else None
        self._exempt: dict[int, bool] = {}  # fd -> a connection to the internal endpoint
        self.held: dict[bytes, int] = {}

    def take(self, key: bytes, fd: int, sequences: int, request_id: str) -> int:
        """Count ``sequences`` more for client ``key``; ProtocolError ``overloaded`` past its
        share. Returns what was counted (0 for an exempt connection), for :meth:`give_back`."""
        if not self.share or self._is_internal(fd):
            return 0
        held = self.held.get(key, 0)
        if held + sequences > self.share:
            raise wire.ProtocolError(
                f"overloaded: this client has {held} sequences in flight and asks for {sequences} more; a client "
                "may hold "
                f"at most {self.share}, a quarter of the server's --max-waiting {self.max_waiting}: retry when "
                "some finish",
                request_id,
                wire.OVERLOADED,
            )
        self.held[key] = held + sequences
        return sequences

    def give_back(self, key: bytes, sequences: int) -> None:
        if sequences:
            left = self.held.get(key, 0) - sequences
            if left > 0:
                self.held[key] = left
            else:
                self.held.pop(key, None)

    def forget(self, fd: int) -> None:
        """The connection on ``fd`` is gone: a later one on the same fd is measured afresh."""
        self._exempt.pop(fd, None)

    def _is_internal(self, fd: int) -> bool:
        exempt = self._exempt.get(fd)
        if exempt is None:
            exempt = self._exempt[fd] = self._internal_path is not None and _local_address(fd) == self._internal_path
        return exempt


def _local_address(fd: int) -> object:
    """The local address of the connection on ``fd`` (an ipc connection's: the bound path)."""
    try:
        sock = socket.socket(fileno=socket.dup(fd))
    except OSError:
        return None
    try:
        return sock.getsockname()
    except OSError:
        return None
    finally:
        sock.close()
