"""Process control: a child announcing it is ready or failed to start (to bin/serve), and
:class:`Shutdown`, asking a process to exit its loop."""

from __future__ import annotations

from msgspec import field

from conveyor.ipc.messages.tagged import Message, message


@message
class Shutdown(Message, tag=23):
    """Ask a process to exit its loop cleanly; ``reason`` is logged and relayed to clients."""

    reason: str


# ---------------------------------------------------------------- any child -> bin/serve


@message
class ProcessReady(Message, tag=40):
    """Sent once by each child when it can take work. ``info`` carries what others need
    from it (the worker reports its KV block count)."""

    process: str
    pid: int
    info: dict[str, int | str | float | bool] = field(default_factory=dict)


@message
class ProcessFailed(Message, tag=41):
    """Sent by a child that cannot start (bad model directory, no GPU): ``reason`` is shown.
    bin/serve also sends it to the frontend's control socket when a data-parallel replica's
    process dies and the others keep serving: ``process`` names it (``worker.1``), and the
    frontend fails that replica's requests alone."""

    process: str
    reason: str
