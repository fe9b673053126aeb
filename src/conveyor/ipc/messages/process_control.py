"""Process control: a child announcing it is ready or failed to start (to bin/serve),
:class:`Shutdown`, asking a process to exit its loop, and the node link between the bin/serve
of each node of a multi-node server (:mod:`conveyor.ipc.node_link`)."""

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


# ---------------------------------------------------------------- node R's bin/serve <-> node 0's


@message
class NodeHello(Message, tag=42):
    """Node ``node_rank`` asks node 0 to join, before its ranks start: ``settings`` are what
    every node must share (versions, the model's config, the flags that shape plans and the
    process group; :func:`conveyor.ipc.node_link.join_settings`), compared by name."""

    node_rank: int
    settings: dict[str, str]


@message
class NodeVerdict(Message, tag=43):
    """Node 0's answer to a :class:`NodeHello`: ``refusal`` empty to admit the node, else why
    not (the settings that differ). Node 0 also sends :class:`Shutdown` on the link when it stops."""

    refusal: str = ""
